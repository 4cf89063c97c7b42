"""The sparse-attention ops in query tiles, with plain jnp: the default path on every platform.

Each tile of query tokens runs the reference (``reference.py``) on its own inside ``lax.map``, so a
step holds one tile's gathered keys and scores at a time, never a score or mask matrix over the
whole step: ``[tile, L]`` scores for the indexer (``L`` the block tables' width in tokens), ``[tile,
top_k]`` rows for the attention. The tile is the largest power of two whose working set fits
``TILE_BYTES``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.kernels.sparse_mla import reference

TILE_BYTES = 1 << 28  # a query tile's gathered rows and scores, float32


def query_tile(num_tokens: int, bytes_per_token: int) -> int:
    """The largest power of two <= ``num_tokens`` whose tokens' working set fits ``TILE_BYTES`` (at least 1)."""
    tile = 1
    while tile * 2 <= num_tokens and tile * 2 * bytes_per_token <= TILE_BYTES:
        tile *= 2
    return tile


def in_tiles(fn, tile: int, per_token, shared):
    """``fn(*per_token_tile, *shared)`` over tiles of the leading axis of ``per_token``, concatenated."""
    num_tokens = per_token[0].shape[0]
    padded = -(-num_tokens // tile) * tile

    def tiles(a, fill):
        a = jnp.pad(a, [(0, padded - num_tokens)] + [(0, 0)] * (a.ndim - 1), constant_values=fill)
        return a.reshape(padded // tile, tile, *a.shape[1:])

    fills = [-1 if jnp.issubdtype(a.dtype, jnp.integer) else 0 for a in per_token]
    out = jax.lax.map(lambda xs: fn(*xs, *shared), tuple(tiles(a, f) for a, f in zip(per_token, fills)))
    return out.reshape(padded, *out.shape[2:])[:num_tokens]


def indexer_select(q, weights, index_cache, positions, token_seq_ids, block_tables, *, scale, top_k: int,
                   cache_scale=None):
    """``reference.indexer_select`` in query tiles (padding rows of the last tile are padding tokens)."""
    num_tokens, heads, width = q.shape
    keys = block_tables.shape[1] * index_cache.shape[1]
    tile = query_tile(num_tokens, 4 * keys * (width + heads + 2))

    def select(q, weights, positions, token_seq_ids, index_cache, block_tables):
        return reference.indexer_select(q, weights, index_cache, positions, token_seq_ids, block_tables, scale=scale,
                                        top_k=top_k, cache_scale=cache_scale)

    return in_tiles(select, tile, (q, weights, positions, token_seq_ids), (index_cache, block_tables))


def sparse_mla_attention(q_latent, q_rope, latent_cache, slots, *, scale, cache_scale=None, sinks=None):
    """``reference.sparse_mla_attention`` in query tiles (``sinks``: per head, the same for every tile)."""
    num_tokens, heads, _ = q_latent.shape
    tile = query_tile(num_tokens, 4 * slots.shape[1] * (latent_cache.shape[-1] + heads))

    def attend(q_latent, q_rope, slots, latent_cache):
        return reference.sparse_mla_attention(q_latent, q_rope, latent_cache, slots, scale=scale,
                                              cache_scale=cache_scale, sinks=sinks)

    return in_tiles(attend, tile, (q_latent, q_rope, slots), (latent_cache,))
