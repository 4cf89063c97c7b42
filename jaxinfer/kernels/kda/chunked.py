"""Kimi Delta Attention in chunks of ``CHUNK`` tokens (WY / UT form), with plain jnp: matmul-shaped,
no per-token loop; the CPU path and the GPU fallback. Same result as ``reference.kda`` up to float32
rounding.

Within a chunk (per head, float32; ``G [C, Dk]`` the in-chunk cumulative sum of g, per key channel),
with the decayed products ``<x_i, k_j>_G = sum_d x_id k_jd exp(G_id - G_jd)`` for ``j <= i``:

- ``L = strict_lower(<beta k, k>_G)``, ``A = (I + L)^-1`` (unit lower-triangular, inverted by doubling);
- ``U = A (beta v)`` and ``W = A (beta k exp(G))``: the chunk's deltas before the carried state;
- with the state ``S`` carried in: ``V = U - W S``, outputs ``(q exp(G)) S + <q, k>_G V``, and
  ``S' = exp(G_last)[:, None] S + (k exp(G_last - G))^T V``.

Numerics: the decay differs per channel, so ``<x, k>_G`` is no plain matmul, and factoring
``exp(G_i - G_j)`` as ``exp(G_i) exp(-G_j)`` overflows float32 once a chunk decays past ~88 (a few
units per token is usual for KDA). As in flash-linear-attention, products are taken relative to a
reference row between ``j`` and ``i``, so that every factor is <= 1: nothing overflows, and where a
factor underflows the exact product is smaller still. The chunk is split in halves, recursively:
for ``j`` in the left half and ``i`` in the right, ``exp(G_i - G_m) exp(G_m - G_j)`` with ``m`` the
left half's last row, a matmul over Dk; the diagonal blocks of ``SUB_CHUNK`` rows form their
``[sub, sub, Dk]`` decays ``exp(G_i - G_j)`` exactly. All other exponents (``G``, ``G_last - G``)
are <= 0. This needs g <= 0, as KDA's gate is.

Varlen: the chunks and the scan carrying the state over them are ``jaxinfer.kernels.recurrence``'s
(a chunk's rows past its sequence's end are zeros: no decay, no write).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfer.kernels.recurrence import Chunks, scan_chunks

CHUNK = 64  # HF's and flash-linear-attention's chunk size
SUB_CHUNK = 4  # rows of the diagonal blocks whose decays are formed exactly (1 to 8 ran alike on the CPU)


def _decayed_products(x, k, cum, sub: int):
    """``<x_i, k_j>_G`` for ``j <= i`` (zero above the diagonal): x [B, H, C, Dk] (B kinds of rows
    against the same keys), k, cum [H, C, Dk] -> [B, H, C, C], built from the diagonal blocks of
    ``sub`` rows up by doubling."""
    b, h, c, d = x.shape
    n = c // sub
    blocks = cum.reshape(h, n, sub, d)
    # Diagonal blocks: the decays exp(G_i - G_j) formed exactly, [H, n, sub, sub, Dk].
    tri = jnp.tril(jnp.ones((sub, sub), bool))[:, :, None]
    diff = blocks[:, :, :, None] - blocks[:, :, None]
    decayed_k = jnp.where(tri, jnp.exp(jnp.where(tri, diff, 0.0)), 0.0) * k.reshape(h, n, 1, sub, d)
    products = jnp.einsum("bhnid,hnijd->bhnij", x.reshape(b, h, n, sub, d), decayed_k)  # [B, H, n, sub, sub]
    # Merge sibling blocks of s rows: rows i of the right one against keys j of the left one, through
    # m, the left one's last row: exp(G_i - G_m) and exp(G_m - G_j), both <= 1, then a matmul.
    s = sub
    while s < c:
        n = c // (2 * s)
        halves = cum.reshape(h, n, 2, s, d)
        mid = halves[:, :, 0, -1:]  # [H, n, 1, Dk]
        right = x.reshape(b, h, n, 2, s, d)[:, :, :, 1] * jnp.exp(halves[:, :, 1] - mid)
        left = k.reshape(h, n, 2, s, d)[:, :, 0] * jnp.exp(mid - halves[:, :, 0])
        below = jnp.einsum("bhnid,hnjd->bhnij", right, left)
        pairs = products.reshape(b, h, n, 2, s, s)
        products = jnp.concatenate([jnp.concatenate([pairs[:, :, :, 0], jnp.zeros_like(below)], -1),
                                    jnp.concatenate([below, pairs[:, :, :, 1]], -1)], -2)
        s *= 2
    return products[:, :, 0]


def _unit_lower_inverse(m):
    """``m^-1`` for unit lower-triangular m [..., C, C] (C a power of two), by doubling: inverted
    diagonal blocks of b rows merge in pairs, ``[[P, 0], [M, Q]]^-1 = [[P^-1, 0], [-Q^-1 M P^-1, Q^-1]]``
    (matmuls only; XLA's triangular solve is slow on the CPU)."""
    c = m.shape[-1]
    inverse = jnp.ones((*m.shape[:-2], c, 1, 1), m.dtype)  # the 1x1 diagonal blocks
    b = 1
    while b < c:
        n = c // (2 * b)
        diagonal = jnp.diagonal(m.reshape(*m.shape[:-2], n, 2 * b, n, 2 * b), axis1=-4, axis2=-2)
        below = jnp.moveaxis(diagonal, -1, -3)[..., b:, :b]  # [..., n, b, b]
        pairs = inverse.reshape(*inverse.shape[:-3], n, 2, b, b)
        top, bottom = pairs[..., 0, :, :], pairs[..., 1, :, :]
        low = -(bottom @ below @ top)
        inverse = jnp.concatenate([jnp.concatenate([top, jnp.zeros_like(low)], -1),
                                   jnp.concatenate([low, bottom], -1)], -2)
        b *= 2
    return inverse[..., 0, :, :]


def _chunk(state, q, k, v, g, beta, sub: int):
    """One chunk of every head: state [H, Dk, Dv]; q, k, g [C, H, Dk]; v [C, H, Dv]; beta [C, H]
    -> (outputs [C, H, Dv], the state after the chunk)."""
    q, k, v, g = (x.transpose(1, 0, 2) for x in (q, k, v, g))  # [H, C, D]
    beta = beta.T  # [H, C]
    c = q.shape[1]
    cum = jnp.cumsum(g, axis=1)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    scores, kk = _decayed_products(jnp.stack([q, k_beta]), k, cum, sub)
    strict = jnp.where(jnp.tril(jnp.ones((c, c), bool), -1), kk, 0.0)
    inverse = _unit_lower_inverse(jnp.eye(c, dtype=jnp.float32) + strict)
    u = inverse @ v_beta
    w = inverse @ (k_beta * jnp.exp(cum))
    v_new = u - w @ state
    out = (q * jnp.exp(cum)) @ state + scores @ v_new
    last = cum[:, -1]  # [H, Dk]
    state = state * jnp.exp(last)[:, :, None] + jnp.einsum(
        "hck,hcv->hkv", k * jnp.exp(last[:, None] - cum), v_new)
    return out.transpose(1, 0, 2), state


def kda(q, k, v, g, beta, cu_seqlens, initial_state, *, chunk: int = CHUNK, sub_chunk: int = SUB_CHUNK):
    """``reference.kda`` in chunks: -> (outputs [T, H, Dv], final states [S, H, Dk, Dv]), float32.
    ``chunk`` is a power of two; ``sub_chunk`` (capped at ``chunk``) divides it."""
    sub_chunk = min(sub_chunk, chunk)
    if chunk & (chunk - 1) or chunk % sub_chunk:
        raise ValueError(f"kda: chunk {chunk} must be a power of two that sub_chunk {sub_chunk} divides")
    chunks = Chunks.of(cu_seqlens, q.shape[0], chunk)
    step = lambda state, *inputs: _chunk(state, *inputs, sub_chunk)  # noqa: E731
    outs, finals = scan_chunks(step, chunks, [chunks.gather(x) for x in (q, k, v, g, beta)], initial_state)
    return chunks.scatter(outs), finals


__all__ = ["CHUNK", "SUB_CHUNK", "kda"]
