"""The lightning indexer's scores in Pallas (Triton lowering), for steps whose score rows fit in memory.

``reference.indexer_scores``: grid ``(token, key block)``; a program gathers ``block_keys`` of the
token's cached index keys through its block table (the cache viewed as ``[pages * page_size, D]``),
takes every indexer head at once, ``relu(scale * q [H, D] x keys [D, keys])`` on the tensor cores,
and sums the heads with the token's weights into one float32 score per key; keys after the token's
position, and every key of a padding token, score -inf. The top-k of each row then runs in XLA
(``reference.select_slots``). ``indexer_select`` runs both in query tiles (``tiled.query_tile``),
so a long prefill holds one tile's ``[tile, L]`` scores at a time, never a matrix over the step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.kernels.sparse_mla import reference, tiled

_MIN_TILE = 16  # tensor-core matmul edge
_BLOCK_KEYS = 64
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def supports(q, weights, index_cache, positions, token_seq_ids, block_tables, *, scale, top_k: int,
             **options) -> bool:
    """A power-of-two key width >= 16 and one dtype for q and the cache (so never an fp8 cache, which
    comes with a ``cache_scale`` option)."""
    width = q.shape[-1]
    return (not options and width >= _MIN_TILE and width == _pow2(width) and q.dtype == index_cache.dtype
            and jnp.dtype(q.dtype) in _DTYPES)


def _kernel(q_ref, w_ref, cache_ref, table_ref, position_ref, seq_ref, out_ref, *, scale: float, page_size: int,
            block_keys: int):
    block = pl.program_id(1)
    key = block * block_keys + lax.broadcasted_iota(jnp.int32, (block_keys,), 0)
    visible = (key <= position_ref[0]) & (seq_ref[0] >= 0)
    rows = (table_ref[key // page_size] * page_size + key % page_size)[:, None]
    columns = lax.broadcasted_iota(jnp.int32, (1, q_ref.shape[-1]), 1)
    keys = plgpu.load(cache_ref.at[rows, columns], mask=visible[:, None], other=0.0)
    per_head = jnp.maximum(jnp.dot(q_ref[...], keys.T, preferred_element_type=jnp.float32) * scale, 0.0)
    scores = jnp.sum(per_head * w_ref[...].astype(jnp.float32)[:, None], axis=0)  # [keys]
    out_ref[...] = jnp.where(visible, scores, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def indexer_scores(q, weights, index_cache, positions, token_seq_ids, block_tables, *, scale, interpret=False):
    """q [T, H, D], weights [T, H] -> float32 scores [T, pages_per_seq * page_size]; see the reference."""
    num_tokens, heads, width = q.shape
    num_pages, page_size, _ = index_cache.shape
    pages_per_seq = block_tables.shape[1]
    num_keys = pages_per_seq * page_size
    block_keys = min(_BLOCK_KEYS, max(_MIN_TILE, _pow2(num_keys)))
    num_blocks = -(-num_keys // block_keys)
    padded_pages = -(-num_blocks * block_keys // page_size)
    seq = jnp.maximum(token_seq_ids, 0)
    tables = jnp.pad(block_tables.astype(jnp.int32)[seq], ((0, 0), (0, padded_pages - pages_per_seq)))
    padded_heads = max(_MIN_TILE, _pow2(heads))  # zero rows: zero weights, no score
    if padded_heads != heads:
        q = jnp.pad(q, ((0, 0), (0, padded_heads - heads), (0, 0)))
        weights = jnp.pad(weights, ((0, 0), (0, padded_heads - heads)))
    scores = pl.pallas_call(
        functools.partial(_kernel, scale=float(scale), page_size=page_size, block_keys=block_keys),
        grid=(num_tokens, num_blocks),
        in_specs=[pl.BlockSpec((None, padded_heads, width), lambda t, b: (t, 0, 0)),
                  pl.BlockSpec((None, padded_heads), lambda t, b: (t, 0)),
                  pl.BlockSpec((num_pages * page_size, width), lambda t, b: (0, 0)),
                  pl.BlockSpec((None, padded_pages), lambda t, b: (t, 0)),
                  pl.BlockSpec((None, 1), lambda t, b: (t, 0)),
                  pl.BlockSpec((None, 1), lambda t, b: (t, 0))],
        out_specs=pl.BlockSpec((None, block_keys), lambda t, b: (t, b)),
        out_shape=jax.ShapeDtypeStruct((num_tokens, num_blocks * block_keys), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="indexer_scores",
    )(q, weights.astype(jnp.float32), index_cache.reshape(num_pages * page_size, width), tables,
      positions.astype(jnp.int32)[:, None], token_seq_ids.astype(jnp.int32)[:, None])
    return scores[:, :num_keys]


def indexer_select(q, weights, index_cache, positions, token_seq_ids, block_tables, *, scale, top_k: int,
                   interpret=False):
    """``indexer_scores`` on the kernel, then XLA's top-k (``reference.select_slots``), a query tile
    at a time."""
    num_keys = block_tables.shape[1] * index_cache.shape[1]
    tile = tiled.query_tile(q.shape[0], 4 * 2 * num_keys)  # a tile's scores and their top-k's sort

    def select(q, weights, positions, token_seq_ids, index_cache, block_tables):
        scores = indexer_scores(q, weights, index_cache, positions, token_seq_ids, block_tables, scale=scale,
                                interpret=interpret)
        return reference.select_slots(scores, token_seq_ids, block_tables, top_k=top_k,
                                      page_size=index_cache.shape[1])

    return tiled.in_tiles(select, tile, (q, weights, positions, token_seq_ids), (index_cache, block_tables))


__all__ = ["indexer_scores", "indexer_select", "supports"]
