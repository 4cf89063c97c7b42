"""The gated delta rule in chunks of ``CHUNK`` tokens (WY / UT form), with plain jnp: matmul-shaped,
no per-token loop; the CPU path and the GPU fallback. Same result as ``reference.gated_delta_rule``
up to float32 rounding.

Within a chunk (per head, float32; ``G`` the in-chunk cumulative sum of g, ``D[i, j] = exp(G_i - G_j)``
for ``j <= i``):

- ``L = strict_lower((beta k) k^T * D)``, ``A = (I + L)^-1`` (a unit lower-triangular solve);
- ``U = A (beta v)`` and ``W = A (beta k exp(G))``: the chunk's deltas before the carried state;
- with the state ``S`` carried in: ``V = U - W S``, outputs ``(q exp(G)) S + lower(q k^T * D) V``,
  and ``S' = exp(G_last) S + (k exp(G_last - G))^T V``.

Varlen: each sequence's rows (``cu_seqlens``) are cut into chunks of its own, at most ``T / CHUNK +
S`` for the step; a chunk's rows past its sequence's end are zeros (no decay, no write), so every
chunk's state is exact. A scan over the chunks carries the state, loading a sequence's
``initial_state`` at its first chunk and keeping the state after its last as its final state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

CHUNK = 64  # HF's and flash-linear-attention's chunk size


def chunk_table(cu_seqlens, num_tokens: int, chunk: int):
    """The step's chunks: (sequence, first row, rows) per chunk, ``num_tokens // chunk + S`` of them
    (unused ones have no rows)."""
    num_seqs = cu_seqlens.shape[0] - 1
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(-(-lengths // chunk)).astype(jnp.int32)])
    index = jnp.arange(num_tokens // chunk + num_seqs, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(offsets[1:], index, side="right"), num_seqs - 1).astype(jnp.int32)
    start = cu_seqlens[seq] + (index - offsets[seq]) * chunk
    rows = jnp.where(index < offsets[-1], jnp.clip(cu_seqlens[seq + 1] - start, 0, chunk), 0)
    return seq, start, rows, index == offsets[seq]


def _chunk(state, q, k, v, g, beta):
    """One chunk of every head: state [H, Dk, Dv]; q, k [C, H, Dk]; v [C, H, Dv]; g, beta [C, H]
    -> (outputs [C, H, Dv], the state after the chunk)."""
    q, k, v = (x.transpose(1, 0, 2) for x in (q, k, v))  # [H, C, D]
    g, beta = g.T, beta.T  # [H, C]
    c = q.shape[1]
    cum = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((c, c), bool))
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, cum[:, :, None] - cum[:, None, :], 0.0)), 0.0)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    strict = jnp.where(jnp.tril(jnp.ones((c, c), bool), -1), jnp.einsum("hik,hjk->hij", k_beta, k) * decay, 0.0)
    eye = jnp.broadcast_to(jnp.eye(c, dtype=jnp.float32), strict.shape)
    inverse = solve_triangular(eye + strict, eye, lower=True, unit_diagonal=True)
    u = inverse @ v_beta
    w = inverse @ (k_beta * jnp.exp(cum)[..., None])
    v_new = u - w @ state
    scores = jnp.einsum("hik,hjk->hij", q, k) * decay  # zero above the diagonal
    out = (q * jnp.exp(cum)[..., None]) @ state + scores @ v_new
    last = cum[:, -1]
    state = state * jnp.exp(last)[:, None, None] + jnp.einsum(
        "hck,hcv->hkv", k * jnp.exp(last[:, None] - cum)[..., None], v_new)
    return out.transpose(1, 0, 2), state


def gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state, *, chunk: int = CHUNK):
    """``reference.gated_delta_rule`` in chunks: -> (outputs [T, H, Dv], final states [S, H, Dk, Dv]),
    float32."""
    num_tokens = q.shape[0]
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    seq, start, rows, first = chunk_table(cu_seqlens.astype(jnp.int32), num_tokens, chunk)
    offsets = jnp.arange(chunk, dtype=jnp.int32)
    index = start[:, None] + offsets[None, :]  # [N, C]
    inside = offsets[None, :] < rows[:, None]
    gather = lambda x: jnp.where(inside.reshape(*inside.shape, *([1] * (x.ndim - 1))),  # noqa: E731
                                 f32(x)[jnp.clip(index, 0, num_tokens - 1)], 0.0)
    chunks = tuple(gather(x) for x in (q, k, v, g, beta))

    def step(carry, xs):
        state, finals = carry
        s, is_first, has_rows, cq, ck, cv, cg, cb = xs
        state = jnp.where(is_first, finals[s], state)
        out, new_state = _chunk(state, cq, ck, cv, cg, cb)
        state = jnp.where(has_rows, new_state, state)
        finals = jnp.where(has_rows, finals.at[s].set(state), finals)
        return (state, finals), out

    init = (jnp.zeros(initial_state.shape[1:], jnp.float32), f32(initial_state))
    (_, finals), outs = jax.lax.scan(step, init, (seq, first, rows > 0, *chunks))
    # Chunk rows back to token rows (each token is one row of one chunk).
    out = jnp.zeros((num_tokens + 1, *outs.shape[2:]), jnp.float32)
    target = jnp.where(inside, index, num_tokens)  # rows past a chunk's end: dropped
    out = out.at[target.reshape(-1)].set(outs.reshape(-1, *outs.shape[2:]), mode="drop")
    return out[:num_tokens], finals


__all__ = ["CHUNK", "chunk_table", "gated_delta_rule"]
