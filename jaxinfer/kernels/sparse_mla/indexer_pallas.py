"""The lightning indexer's scores in Pallas (Triton lowering), for steps whose score rows fit in memory.

``reference.indexer_scores``: grid ``(token, key block)``; a program gathers ``block_keys`` of the
token's cached index keys through its block table (the cache viewed as ``[pages * page_size, D]``),
takes every indexer head at once, ``relu(scale * q [H, D] x keys [D, keys])`` on the tensor cores,
and sums the heads with the token's weights into one float32 score per key; keys after the token's
position, and every key of a padding token, score -inf. The top-k of each row then runs in XLA
(``reference.select_slots``). ``indexer_select`` runs both in query tiles (``tiled.query_tile``),
so a long prefill holds one tile's ``[tile, L]`` scores at a time, never a matrix over the step.

**An fp8 key cache** (``kv_cache_dtype="fp8"``, with its ``cache_scale``): the keys are gathered as
e4m3, converted to q's dtype in registers (exact: e4m3 values are bf16 values), and the scale joins
``scale`` on the dot products, before the relu. Not measured on a GPU yet.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.cache import fp8
from jaxinfer.kernels.sparse_mla import reference, tiled

_MIN_TILE = 16  # tensor-core matmul edge
_BLOCK_KEYS = 64
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _unsupported_reason(q, index_cache, cache_scale, options) -> str | None:
    """Why the kernel cannot take the call, or None where it can."""
    if options:
        return f"unknown options {sorted(options)}"
    width = q.shape[-1]
    if not (width >= _MIN_TILE and width == _pow2(width)):
        return f"the key width {width} must be a power of two >= {_MIN_TILE}"
    if jnp.dtype(q.dtype) not in _DTYPES:
        return f"q must be one of {[d.name for d in _DTYPES]}, not {q.dtype}"
    if fp8.is_fp8(index_cache.dtype):
        if cache_scale is None or math.prod(getattr(cache_scale, "shape", ())) != 1:
            return "an fp8 index key cache comes with its scalar cache_scale"
    elif q.dtype != index_cache.dtype:
        return f"q ({q.dtype}) and the index key cache ({index_cache.dtype}) must share a dtype unless it is fp8"
    elif cache_scale is not None:
        return f"a cache_scale is given for a {jnp.dtype(index_cache.dtype).name} index key cache, which is not fp8"
    return None


def supports(q, weights, index_cache, positions, token_seq_ids, block_tables, *, scale, top_k: int,
             cache_scale=None, **options) -> bool:
    """A power-of-two key width >= 16, q in bf16 / f16 / f32 and the cache in q's dtype, or in fp8
    with its scalar ``cache_scale`` (a scale only with an fp8 cache)."""
    return _unsupported_reason(q, index_cache, cache_scale, options) is None


def _kernel(q_ref, w_ref, cache_ref, table_ref, position_ref, seq_ref, *rest, scale: float, page_size: int,
            block_keys: int):
    """One (token, key block). An fp8 cache's scale is the first of ``rest`` (an input after the
    sequence ids), the output ref the last."""
    out_ref = rest[-1]
    if fp8.is_fp8(cache_ref.dtype):
        scale = scale * rest[0][0]
    block = pl.program_id(1)
    key = block * block_keys + lax.broadcasted_iota(jnp.int32, (block_keys,), 0)
    visible = (key <= position_ref[0]) & (seq_ref[0] >= 0)
    rows = (table_ref[key // page_size] * page_size + key % page_size)[:, None]
    columns = lax.broadcasted_iota(jnp.int32, (1, q_ref.shape[-1]), 1)
    keys = plgpu.load(cache_ref.at[rows, columns], mask=visible[:, None], other=0.0)
    if fp8.is_fp8(cache_ref.dtype):  # e4m3 -> q's dtype, in registers
        keys = keys.astype(q_ref.dtype)
    per_head = jnp.maximum(jnp.dot(q_ref[...], keys.T, preferred_element_type=jnp.float32) * scale, 0.0)
    scores = jnp.sum(per_head * w_ref[...].astype(jnp.float32)[:, None], axis=0)  # [keys]
    out_ref[...] = jnp.where(visible, scores, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def indexer_scores(q, weights, index_cache, positions, token_seq_ids, block_tables, *, scale, cache_scale=None,
                   interpret=False):
    """q [T, H, D], weights [T, H] -> float32 scores [T, pages_per_seq * page_size]; see the reference.
    An fp8 cache comes with its float32 ``cache_scale``. A call ``supports`` refuses raises ValueError."""
    reason = _unsupported_reason(q, index_cache, cache_scale, {})
    if reason is not None:
        raise ValueError(f"indexer_scores kernel: {reason}")
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
    inputs = [q, weights.astype(jnp.float32), index_cache.reshape(num_pages * page_size, width), tables,
              positions.astype(jnp.int32)[:, None], token_seq_ids.astype(jnp.int32)[:, None]]
    in_specs = [pl.BlockSpec((None, padded_heads, width), lambda t, b: (t, 0, 0)),
                pl.BlockSpec((None, padded_heads), lambda t, b: (t, 0)),
                pl.BlockSpec((num_pages * page_size, width), lambda t, b: (0, 0)),
                pl.BlockSpec((None, padded_pages), lambda t, b: (t, 0)),
                pl.BlockSpec((None, 1), lambda t, b: (t, 0)),
                pl.BlockSpec((None, 1), lambda t, b: (t, 0))]
    if cache_scale is not None:
        inputs.append(jnp.reshape(cache_scale, (1,)).astype(jnp.float32))
        in_specs.append(pl.BlockSpec((1,), lambda t, b: (0,)))
    scores = pl.pallas_call(
        functools.partial(_kernel, scale=float(scale), page_size=page_size, block_keys=block_keys),
        grid=(num_tokens, num_blocks),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, block_keys), lambda t, b: (t, b)),
        out_shape=jax.ShapeDtypeStruct((num_tokens, num_blocks * block_keys), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="indexer_scores",
    )(*inputs)
    return scores[:, :num_keys]


def indexer_select(q, weights, index_cache, positions, token_seq_ids, block_tables, *, scale, top_k: int,
                   cache_scale=None, interpret=False):
    """``indexer_scores`` on the kernel, then XLA's top-k (``reference.select_slots``), a query tile
    at a time. An fp8 cache comes with its float32 ``cache_scale``."""
    num_keys = block_tables.shape[1] * index_cache.shape[1]
    tile = tiled.query_tile(q.shape[0], 4 * 2 * num_keys)  # a tile's scores and their top-k's sort

    def select(q, weights, positions, token_seq_ids, index_cache, block_tables):
        scores = indexer_scores(q, weights, index_cache, positions, token_seq_ids, block_tables, scale=scale,
                                cache_scale=cache_scale, interpret=interpret)
        return reference.select_slots(scores, token_seq_ids, block_tables, top_k=top_k,
                                      page_size=index_cache.shape[1])

    return tiled.in_tiles(select, tile, (q, weights, positions, token_seq_ids), (index_cache, block_tables))


__all__ = ["indexer_scores", "indexer_select", "supports"]
