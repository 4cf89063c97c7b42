"""Lightning attention in chunks of ``CHUNK`` tokens, with plain jnp: matmul-shaped, no per-token
loop; the CPU path and the GPU fallback. Same result as ``reference.lightning_attention`` up to
float32 rounding.

Within a chunk of ``n`` rows (per head, float32; ``s`` the head's slope, ``D[i, j] = exp(-s (i - j))``
for ``j <= i``, else 0), with the state ``S`` carried in:

    outputs  O = (q D_q) S + (q k^T * D) v          with D_q[i] = exp(-s (i + 1))
    state    S' = exp(-s n) S + (k D_k)^T v          with D_k[j] = exp(-s (n - 1 - j)) = D[n - 1, j]

which is HF's block form (``MiniMaxLightningAttention``, blocks of ``block_size``). Every decay is
an exponent of a non-positive number, so nothing overflows (far-apart tokens underflow to 0, as
their true weights do in float32); the tables depend only on the slopes and are built once. The
intra-chunk products ``(q k^T * D) v`` do not depend on the state and run for all chunks at once;
a scan over the chunks carries the state through the two state products.

Varlen: each sequence's rows (``cu_seqlens``) are cut into chunks of its own
(``gated_delta.chunked.chunk_table``), at most ``T / CHUNK + S`` for the step; a chunk's rows past
its sequence's end are zeros and its decays use its own row count, so every chunk's state is
exact. The scan loads a sequence's ``initial_state`` at its first chunk and keeps the state after
its last as its final state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxinfer.kernels.gated_delta.chunked import chunk_table

# Chunks of 64 rather than HF's block_size of 256: the result does not depend on it (up to
# rounding); 64 wastes at most 63 padded rows per sequence of a packed step, keeps the [C, C]
# intra-chunk work (C (Dk + Dv) per token) on a par with the state work (2 Dk Dv per token) at
# head dims 64 to 128, and a quarter of the score memory (T H C floats) of 256.
CHUNK = 64


def decay_tables(slope, chunk: int):
    """Per head: ``within [H, C, C]`` = exp(-s (i - j)) for j <= i, else 0, and ``to_query [H, C]``
    = exp(-s (i + 1)) (row i's weight on the state carried into the chunk); float32."""
    slope = slope.astype(jnp.float32)
    i = jnp.arange(chunk)
    gap = (i[:, None] - i[None, :]).astype(jnp.float32)
    lower = gap >= 0
    within = jnp.where(lower, jnp.exp(-slope[:, None, None] * jnp.where(lower, gap, 0.0)), 0.0)
    to_query = jnp.exp(-slope[:, None] * (i + 1).astype(jnp.float32))
    return within, to_query


@functools.partial(jax.jit, static_argnames=("chunk",))
def lightning_attention(q, k, v, slope, cu_seqlens, initial_state, *, chunk: int = CHUNK):
    """``reference.lightning_attention`` in chunks: -> (outputs [T, H, Dv], final states
    [S, H, Dk, Dv]), float32."""
    num_tokens = q.shape[0]
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    seq, start, rows, first = chunk_table(cu_seqlens.astype(jnp.int32), num_tokens, chunk)
    offsets = jnp.arange(chunk, dtype=jnp.int32)
    index = start[:, None] + offsets[None, :]  # [N, C]
    inside = offsets[None, :] < rows[:, None]
    gather = lambda x: jnp.where(inside[:, :, None, None], f32(x)[jnp.clip(index, 0, num_tokens - 1)],  # noqa: E731
                                 0.0).transpose(0, 2, 1, 3)  # [N, H, C, D]
    cq, ck, cv = gather(q), gather(k), gather(v)

    within, to_query = decay_tables(slope, chunk)
    intra = jnp.einsum("nhij,nhjv->nhiv", jnp.einsum("nhik,nhjk->nhij", cq, ck) * within, cv)
    last = jnp.maximum(rows - 1, 0)
    to_end = within[:, last, :].transpose(1, 0, 2)  # [N, H, C]: exp(-s (n - 1 - j)), 0 past the rows
    carried = to_query[:, last].T  # [N, H]: exp(-s n), the state's decay over the chunk

    def step(carry, xs):
        state, finals = carry
        s, is_first, has_rows, q_c, k_c, v_c, to_end_c, carried_c = xs
        state = jnp.where(is_first, finals[s], state)
        out = (q_c * to_query[..., None]) @ state
        new_state = state * carried_c[:, None, None] + jnp.einsum("hck,hcv->hkv", k_c * to_end_c[..., None], v_c)
        state = jnp.where(has_rows, new_state, state)
        finals = jnp.where(has_rows, finals.at[s].set(state), finals)
        return (state, finals), out

    init = (jnp.zeros(initial_state.shape[1:], jnp.float32), f32(initial_state))
    (_, finals), inter = jax.lax.scan(step, init, (seq, first, rows > 0, cq, ck, cv, to_end, carried))
    outs = (intra + inter).transpose(0, 2, 1, 3)  # [N, C, H, Dv]
    # Chunk rows back to token rows (each token is one row of one chunk).
    out = jnp.zeros((num_tokens, *outs.shape[2:]), jnp.float32)
    target = jnp.where(inside, index, num_tokens)  # rows past a chunk's end: dropped
    out = out.at[target.reshape(-1)].set(outs.reshape(-1, *outs.shape[2:]), mode="drop")
    return out, finals


__all__ = ["CHUNK", "decay_tables", "lightning_attention"]
