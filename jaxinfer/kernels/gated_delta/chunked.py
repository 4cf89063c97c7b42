"""The gated delta rule in chunks of ``CHUNK`` tokens (WY / UT form), with plain jnp: matmul-shaped,
no per-token loop; the CPU path and the GPU fallback. Same result as ``reference.gated_delta_rule``
up to float32 rounding.

Within a chunk (per head, float32; ``G`` the in-chunk cumulative sum of g, ``D[i, j] = exp(G_i - G_j)``
for ``j <= i``):

- ``L = strict_lower((beta k) k^T * D)``, ``A = (I + L)^-1`` (a unit lower-triangular solve);
- ``U = A (beta v)`` and ``W = A (beta k exp(G))``: the chunk's deltas before the carried state;
- with the state ``S`` carried in: ``V = U - W S``, outputs ``(q exp(G)) S + lower(q k^T * D) V``,
  and ``S' = exp(G_last) S + (k exp(G_last - G))^T V``.

Varlen: the chunks and the scan carrying the state over them are ``jaxinfer.kernels.recurrence``'s
(a chunk's rows past its sequence's end are zeros: no decay, no write).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

from jaxinfer.kernels.recurrence import Chunks, scan_chunks

CHUNK = 64  # HF's and flash-linear-attention's chunk size


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
    chunks = Chunks.of(cu_seqlens, q.shape[0], chunk)
    outs, finals = scan_chunks(_chunk, chunks, [chunks.gather(x) for x in (q, k, v, g, beta)], initial_state)
    return chunks.scatter(outs), finals


__all__ = ["CHUNK", "gated_delta_rule"]
