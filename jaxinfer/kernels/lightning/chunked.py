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

Varlen: the chunks and the scan carrying the state over them are ``jaxinfer.kernels.recurrence``'s; a
chunk's rows past its sequence's end are zeros and its decays use its own row count.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxinfer.kernels.recurrence import Chunks, scan_chunks

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
    chunks = Chunks.of(cu_seqlens, q.shape[0], chunk)
    cq, ck, cv = (chunks.gather(x).transpose(0, 2, 1, 3) for x in (q, k, v))  # [N, H, C, D]

    within, to_query = decay_tables(slope, chunk)
    intra = jnp.einsum("nhij,nhjv->nhiv", jnp.einsum("nhik,nhjk->nhij", cq, ck) * within, cv)
    last = jnp.maximum(chunks.rows - 1, 0)
    to_end = within[:, last, :].transpose(1, 0, 2)  # [N, H, C]: exp(-s (n - 1 - j)), 0 past the rows
    carried = to_query[:, last].T  # [N, H]: exp(-s n), the state's decay over the chunk

    def step(state, q_c, k_c, v_c, to_end_c, carried_c):
        out = (q_c * to_query[..., None]) @ state
        return out, state * carried_c[:, None, None] + jnp.einsum("hck,hcv->hkv", k_c * to_end_c[..., None], v_c)

    inter, finals = scan_chunks(step, chunks, (cq, ck, cv, to_end, carried), initial_state)
    return chunks.scatter((intra + inter).transpose(0, 2, 1, 3)), finals  # chunk rows [N, C, H, Dv] to tokens


__all__ = ["CHUNK", "decay_tables", "lightning_attention"]
