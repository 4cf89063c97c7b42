"""Sparse MLA attention in Pallas (Triton lowering): each query token over its selected latent rows.

``reference.sparse_mla_attention``, absorbed form, for prefill and decode alike: a query token's
keys are the cache rows its selection lists (``slots [T, K]``, -1 for none), so the kernel never
looks at a block table or a score matrix over the step. Grid ``(token, head block, split)``: a
program takes ``block_heads`` heads of one token and walks its split's share of the ``K`` slots
``block_keys`` at a time; each
block is one flat gather of cache rows (the cache viewed as ``[pages * page_size, R + P]``), split
into a ``[block_keys, R]`` latent tile and a ``[block_keys, P]`` rope tile, masked where the slot is
-1. Scores are two tensor-core matmuls, the latent tile is also the value; the online softmax and
the ``[heads, R]`` accumulator are float32. A token with no slot gives zeros. With more than one
split each program writes partial results that the MLA decode kernel's merge combines, as in its
split-KV decoding: a step of few tokens then still fills the GPU.

Tiles come from the MLA decode kernel's rule (``mla.decode_pallas.plan_blocking``, the same
register and shared-memory budgets) with the selection's width as the key span. ``num_splits``
defaults to the most (a power of two) whose programs still fit one wave of the SMs
(``default_num_splits``): every program walks as many slots, so a partial second wave would cost a
whole program's time.

**An fp8 cache** (``kv_cache_dtype="fp8"``, with its ``cache_scale``): as in the MLA decode kernel,
the rows are gathered as e4m3 and converted to q's dtype in registers, the scores are multiplied by
the scale and so is the output (the values are the latent rows); the budgets count the tiles at q's
width (``mla_decode.tile_itemsize``), so an fp8 call is tiled, split and chosen as the same call
over a cache in q's dtype. Not measured on a GPU yet.
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
from jaxinfer.kernels import registry
from jaxinfer.kernels.mla import decode_pallas as mla_decode

_TUNING = ("block_heads", "block_keys", "num_splits", "num_warps", "num_stages")


def _unsupported_reason(q_latent, q_rope, cache, slots, options) -> str | None:
    """Why the kernel cannot take this call, or None where it can (``options``: tuning keywords and
    an fp8 cache's ``cache_scale``)."""
    if "sinks" in options:
        return "per-head sinks are not in the kernel's online softmax: the tiled path serves such calls"
    unknown = sorted(set(options) - set(_TUNING) - {"cache_scale"})
    if unknown:
        return f"unknown options {unknown}"
    reason = mla_decode._unsupported_reason(q_latent, q_rope, cache, {"num_splits": 1, **options})
    if reason is not None:
        return reason
    if slots.ndim != 2 or slots.shape[0] != q_latent.shape[0] or not jnp.issubdtype(slots.dtype, jnp.integer):
        return f"slots must be integer [T={q_latent.shape[0]}, K], not {slots.dtype}{slots.shape}"
    if "cache_scale" in options and math.prod(getattr(options["cache_scale"], "shape", ())) != 1:
        return "cache_scale must be a scalar (shape [] or [1])"
    return None


def _scaled(cache_scale) -> dict:
    return {} if cache_scale is None else {"cache_scale": cache_scale}


def supports(q_latent, q_rope, cache, slots, *, scale=None, cache_scale=None, **options) -> bool:
    """Whether the kernel takes the call: the MLA decode kernel's dtypes (an fp8 cache with its scalar
    ``cache_scale``, and a scale only with one), power-of-two R and P and budgets, and an integer
    ``[T, K]`` selection. Calls with per-head ``sinks`` are refused (the tiled path serves them)."""
    return _unsupported_reason(q_latent, q_rope, cache, slots, {**options, **_scaled(cache_scale)}) is None


def default_num_splits(num_tokens, num_heads, top_k, latent_dim, rope_dim, itemsize, *, sms=None, **tuning) -> int:
    """The most splits, a power of two, whose (token, head block, split) programs fit one wave of the
    SMs (``sms``; this process's GPU's where None), at most one per key block and what one combine
    program merges. At DeepSeek's shape on the H200 one decode token (4 head blocks) ran 103 us whole
    and 11.8 us in 32 splits; 32 tokens (128 programs) 129 us whole and 138 us in 2 splits
    (benchmarks/results/2026-12-03-h200-r2/mla_check.json)."""
    return _pairs_and_splits(num_tokens, num_heads, top_k, latent_dim, rope_dim, itemsize, sms, tuning)[1]


def programs(q_latent, q_rope, cache, slots, *, sms: int) -> int:
    """The (token, head block, split) programs of a call ``supports`` takes, at the default tiling on
    a GPU of ``sms`` SMs."""
    num_tokens, num_heads, latent_dim = q_latent.shape
    pairs, splits = _pairs_and_splits(num_tokens, num_heads, slots.shape[1], latent_dim, q_rope.shape[-1],
                                      mla_decode.tile_itemsize(q_latent, cache), sms, {})
    return pairs * splits


def _pairs_and_splits(num_tokens, num_heads, top_k, latent_dim, rope_dim, itemsize, sms, tuning):
    """(token, head block) pairs and ``default_num_splits``."""
    plan = mla_decode.plan_blocking(num_tokens, num_heads, top_k, latent_dim, rope_dim, itemsize,
                                    **{**tuning, "num_splits": 1})
    pairs = num_tokens * -(-num_heads // plan.block_heads)
    limit = min(-(-top_k // plan.block_keys), mla_decode.max_splits(latent_dim))
    sms = registry.target_sms() if sms is None else sms
    splits = 1
    while 2 * splits <= limit and 2 * splits * pairs <= sms:
        splits *= 2
    return pairs, splits


def _kernel(q_latent_ref, q_rope_ref, cache_ref, slots_ref, *out_refs, scale: float, block_keys: int,
            blocks_per_split: int, num_splits: int):
    """One (token, head block, split): the online softmax over the split's slot blocks, written by
    ``mla_decode.write_split``. An fp8 cache's scale is the first of ``out_refs`` (an input after
    the slots)."""
    cache_scale = None
    if fp8.is_fp8(cache_ref.dtype):
        scale_ref, *out_refs = out_refs
        cache_scale = scale_ref[0]
        scale = scale * cache_scale
    latent_dim = q_latent_ref.shape[-1]
    block_heads = q_latent_ref.shape[0]
    q_latent = q_latent_ref[...]
    q_rope = q_rope_ref[...]

    def attend(block, carry):
        slot = slots_ref[pl.ds(block * block_keys, block_keys)]
        return mla_decode.attend_rows(carry, q_latent, q_rope, cache_ref, jnp.maximum(slot, 0)[:, None], slot >= 0,
                                      scale=scale)

    init = (jnp.zeros((block_heads, latent_dim), jnp.float32), jnp.full((block_heads,), mla_decode.MASK, jnp.float32),
            jnp.zeros((block_heads,), jnp.float32))
    first = pl.program_id(2) * blocks_per_split if num_splits > 1 else 0  # one split: a static trip count
    o, m, l = lax.fori_loop(first, first + blocks_per_split, attend, init)
    if cache_scale is not None:  # o is a sum of latent rows: their scale once, here
        o = o * cache_scale
    mla_decode.write_split(out_refs, o, m, l)


@functools.partial(jax.jit, static_argnames=("scale", "interpret") + _TUNING)
def sparse_mla_attention(q_latent, q_rope, cache, slots, *, scale, cache_scale=None, interpret=False, **tuning):
    """q_latent [T, H, R], q_rope [T, H, P]; cache [pages, page_size, R + P]; slots [T, K] int (-1:
    none) -> [T, H, R] in q_latent's dtype. An fp8 cache comes with its float32 ``cache_scale``.
    ``tuning``: ``block_heads``, ``block_keys``, ``num_splits`` (``default_num_splits`` where
    absent), ``num_warps``, ``num_stages`` (``plan_blocking``'s where absent). A call ``supports``
    refuses raises ValueError."""
    reason = _unsupported_reason(q_latent, q_rope, cache, slots, {**tuning, **_scaled(cache_scale)})
    if reason is not None:
        raise ValueError(f"sparse_mla_attention kernel: {reason}")
    num_tokens, num_heads, latent_dim = q_latent.shape
    rope_dim = q_rope.shape[-1]
    num_pages, page_size, width = cache.shape
    top_k = slots.shape[1]
    shape = (num_tokens, num_heads, top_k, latent_dim, rope_dim, mla_decode.tile_itemsize(q_latent, cache))
    if "num_splits" not in tuning:
        tuning = {**tuning, "num_splits": default_num_splits(*shape, **tuning)}
    plan = mla_decode.plan_blocking(*shape, **tuning)
    num_blocks = -(-top_k // plan.block_keys)
    blocks_per_split = -(-num_blocks // plan.num_splits)
    num_splits = -(-num_blocks // blocks_per_split)
    # Whole splits of whole blocks are read: pad the selection with "none".
    slots = jnp.pad(slots.astype(jnp.int32), ((0, 0), (0, num_splits * blocks_per_split * plan.block_keys - top_k)),
                    constant_values=-1)
    head_blocks = -(-num_heads // plan.block_heads)
    padded_heads = head_blocks * plan.block_heads
    if padded_heads != num_heads:  # zero query rows: their outputs are dropped
        pad = ((0, 0), (0, padded_heads - num_heads), (0, 0))
        q_latent, q_rope = jnp.pad(q_latent, pad), jnp.pad(q_rope, pad)
    heads = plan.block_heads
    inputs = [q_latent, q_rope, cache.reshape(num_pages * page_size, width), slots]
    in_specs = [pl.BlockSpec((None, heads, latent_dim), lambda t, h, k: (t, h, 0)),
                pl.BlockSpec((None, heads, rope_dim), lambda t, h, k: (t, h, 0)),
                pl.BlockSpec((num_pages * page_size, width), lambda t, h, k: (0, 0)),  # the cache as rows
                pl.BlockSpec((None, slots.shape[1]), lambda t, h, k: (t, 0))]
    if cache_scale is not None:
        inputs.append(jnp.reshape(cache_scale, (1,)).astype(jnp.float32))
        in_specs.append(pl.BlockSpec((1,), lambda t, h, k: (0,)))
    out_specs, out_shape = mla_decode.split_outputs(num_tokens, padded_heads, heads, num_splits, latent_dim,
                                                    q_latent.dtype)
    result = pl.pallas_call(
        functools.partial(_kernel, scale=float(scale), block_keys=plan.block_keys, blocks_per_split=blocks_per_split,
                          num_splits=num_splits),
        grid=(num_tokens, head_blocks, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps, num_stages=plan.num_stages),
        interpret=interpret,
        name="sparse_mla_attention",
    )(*inputs)
    if num_splits == 1:
        return result[0][:, :num_heads]
    return mla_decode.combine_splits(*result, num_splits=num_splits, num_heads=num_heads, dtype=q_latent.dtype,
                                     interpret=interpret, name="sparse_mla_combine")


__all__ = ["sparse_mla_attention", "supports"]
