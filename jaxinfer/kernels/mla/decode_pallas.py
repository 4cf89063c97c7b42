"""MLA paged decode attention in Pallas (Triton lowering): split-KV flash decoding in the latent space.

One query per sequence (``reference.mla_paged_decode_attention``). The cache has no head axis: every
head of a sequence reads the same rows ``[latent (R) | k_rope (P)]``, so a program takes a block of
``block_heads`` heads of one sequence and reads each cache row once for all of them. Grid
``(sequence, head block, split)``: a split walks its share of the sequence ``block_keys`` keys at a
time. Each block is one flat gather of cache rows (``page_id * page_size + offset`` from the block
table, the cache viewed as ``[pages * page_size, R + P]``: any page size), loaded as a ``[block_keys,
R]`` latent tile and a ``[block_keys, P]`` rope tile, masked past the sequence's length. Scores are
two tensor-core matmuls, ``[heads, R] x [R, keys] + [heads, P] x [P, keys]``; the same latent tile is
the value of ``[heads, keys] x [keys, R]``. The online softmax and the ``[heads, R]`` accumulator are
float32.

With one split the program normalises and writes the output itself. Otherwise each split writes its
partial ``o`` (unnormalised), row max ``m`` and row sum ``l``, and a second small kernel, one program
per (sequence, head), merges them and writes the output in the query's dtype. A sequence of length 0
(a padding row) gives zeros.

**Tiling rule** (``plan_blocking``), from the shapes and two budgets, never from one model's sizes:

- ``num_warps`` 4, or 8 where even a 16-head accumulator exceeds 4 warps' budget (R > 1024).
- ``block_heads``: the largest power of two from 16 (the tensor cores' smallest M; heads past the
  head count are zero rows) up to the head count whose float32 ``[heads, R]`` accumulator fits
  ``_ACCUMULATOR_BYTES_PER_WARP`` per warp: 128 of each thread's 255 32-bit registers, the rest left
  to the matmul operands and addresses.
- ``block_keys``: the largest power of two in [16, 128], and no longer than the block table's span,
  whose shared memory fits a block's 227 KiB: ``num_stages`` pipelined gathers of ``(R + P)``
  elements per key plus the query tile (a matmul operand) during the loop, the accumulator's layout
  conversion after it.
- ``num_splits``: enough programs for two waves of the GPU's SMs (``_target_programs()``), at most one
  per key block and at most what one combine program holds in registers (``_COMBINE_ELEMENTS``
  partial-output elements: ``splits * R``).

At DeepSeek-V3's shape (H 128, R 512, P 64, bf16) that is 32 heads (64 KiB of accumulator in 4
warps, 4 head blocks per sequence), 64-key blocks (180 KiB of shared memory) and 32 splits at one
sequence, 4 at 32, 1 at 128; ``docs/performance.md`` ("MLA decode") has the blockings tried.

**An fp8 cache** (``kv_cache_dtype="fp8"``, with its ``cache_scale``): the rows are gathered as e4m3
(half the bytes of bf16) and converted to q's dtype in registers (exact: e4m3 values are bf16
values); the scores are multiplied by the scale, and so is the output (the values are the latent
rows). The shared-memory budget still counts the tiles at q's width. Not measured on a GPU yet; the
kernel serves fp8 caches where it serves the same call in q's dtype (``preferred`` unchanged).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.cache import fp8
from jaxinfer.kernels import pdl, registry

MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # a finite -inf: no NaN from exp(m - m) on empty rows
_MIN_TILE = 16  # the tensor cores' smallest matmul edge (M, N and K of tl.dot)
_MAX_BLOCK_KEYS = 128
_ACCUMULATOR_BYTES_PER_WARP = 32 * 128 * 4  # 32 threads x 128 of their 255 registers, 4 bytes each
_WARP_CHOICES = (4, 8)
_SHARED_BYTES = 227 * 1024  # shared memory one Hopper block may use
_DEFAULT_STAGES = 2
_COMBINE_ELEMENTS = 16384  # partial-output elements one combine program (one head) holds in registers
_MAX_ELEMENT_OFFSET = 2**31 - 1  # element offsets into the cache are 32-bit integers
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_TUNING = ("block_heads", "block_keys", "num_splits", "num_warps", "num_stages")


def _target_programs() -> int:
    """Two waves of programs over the GPU's SMs (one program per SM: its shared memory)."""
    return 2 * registry.target_sms()


def max_splits(latent_dim: int) -> int:
    """The most splits one combine program merges: ``_COMBINE_ELEMENTS`` partial-output elements."""
    return max(1, _COMBINE_ELEMENTS // latent_dim)  # a power of two: latent_dim is one


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _is_pow2(n) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


class Blocking(NamedTuple):
    """A call's tiling: heads and keys per program step, splits of the context, Triton's warps and
    pipeline stages."""

    block_heads: int
    block_keys: int
    num_splits: int
    num_warps: int
    num_stages: int


def _accumulator_bytes(block_heads: int, latent_dim: int) -> int:
    return 4 * block_heads * latent_dim


def _shared_bytes(block_heads: int, block_keys: int, latent_dim: int, rope_dim: int, itemsize: int,
                  num_stages: int) -> int:
    """Shared memory of a program: the pipelined key-block gathers and the query tile (a matmul
    operand) during the loop, or the accumulator's layout conversion after it."""
    row_bytes = (latent_dim + rope_dim) * itemsize
    return max((num_stages * block_keys + block_heads) * row_bytes, _accumulator_bytes(block_heads, latent_dim))


def plan_blocking(num_seqs: int, num_heads: int, tokens_per_seq: int | None, latent_dim: int, rope_dim: int,
                  itemsize: int, *, block_heads=None, block_keys=None, num_splits=None, num_warps=None,
                  num_stages=None) -> Blocking:
    """The tiling of a call (module docstring); a given value is kept and the others derived around
    it. ``tokens_per_seq`` (the block table's span; None: unknown) bounds the key block and the
    splits. Raises ValueError where a given value is malformed or the tiles exceed a budget."""
    num_stages = _DEFAULT_STAGES if num_stages is None else num_stages
    if not (isinstance(num_stages, int) and num_stages >= 1):
        raise ValueError(f"num_stages={num_stages!r} must be a positive integer")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps={num_warps!r} must be a power of two from 1 to 16")
    if num_warps is None:
        smallest = block_heads or _MIN_TILE
        num_warps = next((w for w in _WARP_CHOICES
                          if _accumulator_bytes(smallest, latent_dim) <= w * _ACCUMULATOR_BYTES_PER_WARP),
                         max(_WARP_CHOICES))
    register_budget = num_warps * _ACCUMULATOR_BYTES_PER_WARP
    if block_heads is None:
        block_heads = _MIN_TILE
        while block_heads < num_heads and _accumulator_bytes(2 * block_heads, latent_dim) <= register_budget:
            block_heads *= 2
    if not (_is_pow2(block_heads) and block_heads >= _MIN_TILE):
        raise ValueError(f"block_heads={block_heads!r} must be a power of two >= {_MIN_TILE}")
    if _accumulator_bytes(block_heads, latent_dim) > register_budget:
        raise ValueError(f"the float32 accumulator of {block_heads} heads x R={latent_dim} needs "
                         f"{_accumulator_bytes(block_heads, latent_dim)} bytes of registers; {num_warps} warps "
                         f"hold {register_budget}")
    shared = functools.partial(_shared_bytes, block_heads, latent_dim=latent_dim, rope_dim=rope_dim,
                               itemsize=itemsize, num_stages=num_stages)
    if block_keys is None:
        block_keys = _MAX_BLOCK_KEYS
        while block_keys > _MIN_TILE and shared(block_keys) > _SHARED_BYTES:
            block_keys //= 2
        if tokens_per_seq:
            block_keys = max(_MIN_TILE, min(block_keys, _next_pow2(tokens_per_seq)))
    if not (_is_pow2(block_keys) and block_keys >= _MIN_TILE):
        raise ValueError(f"block_keys={block_keys!r} must be a power of two >= {_MIN_TILE}")
    if shared(block_keys) > _SHARED_BYTES:
        raise ValueError(f"{block_heads} heads and {num_stages} stages of {block_keys} cache rows of "
                         f"{latent_dim + rope_dim} x {itemsize} bytes need {shared(block_keys)} bytes of shared "
                         f"memory; a block has {_SHARED_BYTES}")
    most_splits = max_splits(latent_dim)
    num_blocks = -(-tokens_per_seq // block_keys) if tokens_per_seq else most_splits
    if num_splits is None:
        pairs = num_seqs * -(-num_heads // block_heads)
        num_splits = min(num_blocks, most_splits, _next_pow2(-(-_target_programs() // max(1, pairs))))
    elif not (isinstance(num_splits, int) and num_splits >= 1):
        raise ValueError(f"num_splits={num_splits!r} must be a positive integer")
    elif num_splits > 1 and _next_pow2(num_splits) > most_splits:
        raise ValueError(f"num_splits={num_splits} partial rows of R={latent_dim} exceed what one combine program "
                         f"holds ({_COMBINE_ELEMENTS} elements)")
    return Blocking(block_heads, block_keys, max(1, min(num_splits, num_blocks)), num_warps, num_stages)


def _unsupported_reason(q_latent, q_rope, cache, options) -> str | None:
    """Why the kernel cannot take this call, or None where it can."""
    if "sinks" in options:
        return "per-head sinks are not in the kernel's online softmax: the reference serves such calls"
    unknown = sorted(set(options) - set(_TUNING) - {"cache_scale"})
    if unknown:
        return f"unknown options {unknown}"
    if fp8.is_fp8(cache.dtype) != ("cache_scale" in options):
        return "an fp8 cache comes with its cache_scale, and only an fp8 cache"
    if q_latent.ndim != 3 or q_rope.ndim != 3 or cache.ndim != 3:
        return "q_latent and q_rope must be [S, H, dim] and the cache [pages, page_size, R + P]"
    num_seqs, num_heads, latent_dim = q_latent.shape
    rope_dim = q_rope.shape[-1]
    if q_rope.shape[:2] != (num_seqs, num_heads):
        return f"q_rope {q_rope.shape} and q_latent {q_latent.shape} disagree on sequences and heads"
    if latent_dim + rope_dim != cache.shape[-1]:
        return f"R={latent_dim} + P={rope_dim} != the cache row width {cache.shape[-1]}"
    dtypes = {jnp.dtype(q_latent.dtype), jnp.dtype(q_rope.dtype)}
    if not fp8.is_fp8(cache.dtype):
        dtypes.add(jnp.dtype(cache.dtype))
    if len(dtypes) != 1 or not dtypes <= set(_DTYPES):
        return (f"q_latent, q_rope and the cache (unless fp8) must share one of {[d.name for d in _DTYPES]}; "
                f"got {sorted(map(str, dtypes | {jnp.dtype(cache.dtype)}))}")
    for name, dim in (("R", latent_dim), ("P", rope_dim)):
        if not (_is_pow2(dim) and dim >= _MIN_TILE):
            return f"{name}={dim} must be a power of two >= {_MIN_TILE} (a Triton tile and a tensor-core K)"
    if cache.size > _MAX_ELEMENT_OFFSET:
        return f"the cache's {cache.size} elements exceed 32-bit element offsets"
    tuning = {name: value for name, value in options.items() if name in _TUNING}
    try:
        plan_blocking(num_seqs, num_heads, None, latent_dim, rope_dim, tile_itemsize(q_latent, cache), **tuning)
    except ValueError as error:
        return str(error)
    return None


def tile_itemsize(q_latent, cache) -> int:
    """The bytes of a cache element as the tiling budgets count it: an fp8 row converted to q's dtype
    takes q's width."""
    return max(jnp.dtype(q_latent.dtype).itemsize, jnp.dtype(cache.dtype).itemsize)


def supports(q_latent, q_rope, cache, **options) -> bool:
    """Whether the kernel takes the call (shapes and dtypes alone; ``options``: the tuning keywords
    of ``mla_paged_decode_attention`` and an fp8 cache's ``cache_scale``): one dtype of bf16 / f16 /
    f32 for q and the cache (or an fp8 cache with its scale), R and P
    powers of two >= 16, a cache addressable with 32-bit element offsets, tiles within the register
    and shared-memory budgets, given tuning values well formed. Calls with per-head ``sinks`` are
    refused (the reference serves them)."""
    return _unsupported_reason(q_latent, q_rope, cache, options) is None


def attend_rows(carry, q_latent, q_rope, cache_ref, rows, visible, *, scale: float):
    """The online-softmax update ``(o, m, l)`` by one gathered block of latent cache rows: ``rows``
    [keys, 1] index the cache viewed as ``[rows, R + P]``, ``visible`` [keys] masks the block (those
    rows are neither read nor counted). q_latent [heads, R], q_rope [heads, P]; float32 state."""
    o, m, l = carry
    latent_dim, rope_dim = q_latent.shape[-1], q_rope.shape[-1]
    latent_columns = lax.broadcasted_iota(jnp.int32, (1, latent_dim), 1)
    rope_columns = latent_dim + lax.broadcasted_iota(jnp.int32, (1, rope_dim), 1)
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32)
    latent = plgpu.load(cache_ref.at[rows, latent_columns], mask=visible[:, None], other=0.0)
    k_rope = plgpu.load(cache_ref.at[rows, rope_columns], mask=visible[:, None], other=0.0)
    if fp8.is_fp8(cache_ref.dtype):  # e4m3 -> q's dtype, in registers; the caller scales scores and output
        latent, k_rope = latent.astype(q_latent.dtype), k_rope.astype(q_latent.dtype)
    s = (dot(q_latent, latent.T) + dot(q_rope, k_rope.T)) * scale  # [heads, keys]
    s = jnp.where(visible[None, :], s, MASK)
    m_next = jnp.maximum(m, s.max(axis=-1))
    correction = jnp.exp(m - m_next)
    p = jnp.where(visible[None, :], jnp.exp(s - m_next[:, None]), 0.0)
    return o * correction[:, None] + dot(p.astype(latent.dtype), latent), m_next, l * correction + p.sum(axis=-1)


def _split_kernel(q_latent_ref, q_rope_ref, cache_ref, block_table_ref, seq_len_ref, *out_refs, scale: float,
                  page_size: int, block_keys: int, blocks_per_split: int, tokens_per_seq: int):
    """One (sequence, head block, split): the online softmax over the split's key blocks, written by
    ``write_split``. An fp8 cache's scale is the first of ``out_refs`` (an input after the lengths)."""
    cache_scale = None
    if fp8.is_fp8(cache_ref.dtype):
        scale_ref, *out_refs = out_refs
        cache_scale = scale_ref[0]
        scale = scale * cache_scale
    latent_dim = q_latent_ref.shape[-1]
    block_heads = q_latent_ref.shape[0]
    split = pl.program_id(2)
    length = jnp.minimum(seq_len_ref[0], tokens_per_seq)  # keys past the block table do not exist
    q_latent = q_latent_ref[...]
    q_rope = q_rope_ref[...]

    def attend(block, carry):
        """Key block ``block``; keys past the length are neither read nor counted (a block with none
        visible changes nothing)."""
        position = block * block_keys + lax.broadcasted_iota(jnp.int32, (block_keys,), 0)
        rows = (block_table_ref[position // page_size] * page_size + position % page_size)[:, None]
        return attend_rows(carry, q_latent, q_rope, cache_ref, rows, position < length, scale=scale)

    init = (jnp.zeros((block_heads, latent_dim), jnp.float32), jnp.full((block_heads,), MASK, jnp.float32),
            jnp.zeros((block_heads,), jnp.float32))
    first = split * blocks_per_split
    if blocks_per_split == 1:  # no loop: the block-table and length reads are issued together
        o, m, l = attend(first, init)
    else:
        last = jnp.minimum(first + blocks_per_split, pl.cdiv(length, block_keys))
        o, m, l = lax.fori_loop(first, jnp.maximum(first, last), attend, init)
    if cache_scale is not None:  # o is a sum of latent rows: their scale once, here
        o = o * cache_scale
    write_split(out_refs, o, m, l)


def write_split(out_refs, o, m, l) -> None:
    """A program's end: with one output ref (one split) the normalised output; with three the split's
    unnormalised ``o``, row max ``m`` and row sum ``l`` for ``combine_splits``."""
    if len(out_refs) == 1:
        (out_ref,) = out_refs
        out_ref[...] = (o / jnp.where(l == 0, 1.0, l)[:, None]).astype(out_ref.dtype)
        return
    o_ref, m_ref, l_ref = out_refs
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def _combine_kernel(o_ref, m_ref, l_ref, out_ref, *, num_splits: int):
    """Merge one head's partial results: ``o_ref`` [slots, R], ``m_ref`` / ``l_ref`` [slots]; slots
    past ``num_splits`` are never written."""
    written = lax.broadcasted_iota(jnp.int32, m_ref.shape, 0) < num_splits
    m = jnp.where(written, m_ref[...], -jnp.inf)
    weight = jnp.exp(m - m.max())  # 0 on unwritten slots
    denom = jnp.where(written, l_ref[...] * weight, 0.0).sum()
    o = jnp.where(written[:, None], o_ref[...] * weight[:, None], 0.0).sum(axis=0)
    out_ref[...] = (o / jnp.where(denom == 0, 1.0, denom)).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "interpret") + _TUNING)
def mla_paged_decode_attention(q_latent, q_rope, cache, block_tables, seq_lens, *, scale, cache_scale=None,
                               interpret=False, **tuning):
    """``reference.mla_paged_decode_attention`` as a split-KV Pallas kernel plus its merge.

    q_latent [S, H, R], q_rope [S, H, P]; cache [pages, page_size, R + P]; block_tables [S,
    pages_per_seq]; seq_lens [S] -> [S, H, R] in q_latent's dtype. ``tuning`` (``plan_blocking``'s
    defaults where absent): ``block_heads``, ``block_keys`` (powers of two >= 16), ``num_splits``,
    ``num_warps``, ``num_stages``. An fp8 cache comes with its float32 ``cache_scale``. A call
    ``supports`` refuses raises ValueError.
    """
    scaled = {} if cache_scale is None else {"cache_scale": cache_scale}
    reason = _unsupported_reason(q_latent, q_rope, cache, {**tuning, **scaled})
    if reason is not None:
        raise ValueError(f"mla_paged_decode_attention kernel: {reason}")
    num_seqs, num_heads, latent_dim = q_latent.shape
    rope_dim = q_rope.shape[-1]
    num_pages, page_size, width = cache.shape
    pages_per_seq = block_tables.shape[1]
    tokens_per_seq = pages_per_seq * page_size
    plan = plan_blocking(num_seqs, num_heads, tokens_per_seq, latent_dim, rope_dim, tile_itemsize(q_latent, cache),
                         **tuning)
    num_blocks = -(-tokens_per_seq // plan.block_keys)
    blocks_per_split = -(-num_blocks // plan.num_splits)
    num_splits = -(-num_blocks // blocks_per_split)
    final = num_splits == 1
    # Whole splits of whole blocks are read from the block table: pad it (the padding is past the length).
    padded_pages = -(-num_splits * blocks_per_split * plan.block_keys // page_size)
    block_tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_pages - pages_per_seq)))
    # Head blocks of zero rows past the head count: their scores are 0 and their outputs dropped.
    head_blocks = -(-num_heads // plan.block_heads)
    padded_heads = head_blocks * plan.block_heads
    if padded_heads != num_heads:
        pad = ((0, 0), (0, padded_heads - num_heads), (0, 0))
        q_latent_rows, q_rope_rows = jnp.pad(q_latent, pad), jnp.pad(q_rope, pad)
    else:
        q_latent_rows, q_rope_rows = q_latent, q_rope
    kernel = functools.partial(_split_kernel, scale=float(scale), page_size=page_size, block_keys=plan.block_keys,
                               blocks_per_split=blocks_per_split, tokens_per_seq=tokens_per_seq)
    heads = plan.block_heads
    in_specs = [
        pl.BlockSpec((None, heads, latent_dim), lambda s, h, k: (s, h, 0)),
        pl.BlockSpec((None, heads, rope_dim), lambda s, h, k: (s, h, 0)),
        pl.BlockSpec((num_pages * page_size, width), lambda s, h, k: (0, 0)),  # the cache as rows
        pl.BlockSpec((None, padded_pages), lambda s, h, k: (s, 0)),
        pl.BlockSpec((None, 1), lambda s, h, k: (s, 0)),
    ]
    inputs = [q_latent_rows, q_rope_rows, cache.reshape(num_pages * page_size, width), block_tables,
              seq_lens.astype(jnp.int32)[:, None]]
    if cache_scale is not None:
        inputs.append(jnp.reshape(cache_scale, (1,)).astype(jnp.float32))
        in_specs.append(pl.BlockSpec((1,), lambda s, h, k: (0,)))
    out_specs, out_shape = split_outputs(num_seqs, padded_heads, heads, num_splits, latent_dim, q_latent.dtype)
    result = pl.pallas_call(
        pdl.with_trigger(kernel, "decode_attention", interpret=interpret),
        grid=(num_seqs, head_blocks, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps, num_stages=plan.num_stages),
        interpret=interpret,
        name="mla_paged_decode_attention",
    )(*inputs)
    if final:
        return result[0][:, :num_heads]
    return combine_splits(*result, num_splits=num_splits, num_heads=num_heads, dtype=q_latent.dtype,
                          interpret=interpret, name="mla_paged_decode_combine")


def split_outputs(num_rows: int, padded_heads: int, block_heads: int, num_splits: int, latent_dim: int, dtype):
    """(out_specs, out_shape) of a ``(row, head block, split)`` grid: the ``[rows, heads, R]`` output
    itself for one split, else each split's partial ``o`` [rows, heads, slots, R] and ``m``, ``l``
    [rows, heads, slots], float32, the split axis allocated to a power of two for ``combine_splits``
    (which masks the slots past ``num_splits``, never written)."""
    if num_splits == 1:
        return ([pl.BlockSpec((None, block_heads, latent_dim), lambda r, h, k: (r, h, 0))],
                [jax.ShapeDtypeStruct((num_rows, padded_heads, latent_dim), dtype)])
    slots = _next_pow2(num_splits)
    return ([pl.BlockSpec((None, block_heads, None, latent_dim), lambda r, h, k: (r, h, k, 0)),
             pl.BlockSpec((None, block_heads, None), lambda r, h, k: (r, h, k)),
             pl.BlockSpec((None, block_heads, None), lambda r, h, k: (r, h, k))],
            [jax.ShapeDtypeStruct((num_rows, padded_heads, slots, latent_dim), jnp.float32),
             jax.ShapeDtypeStruct((num_rows, padded_heads, slots), jnp.float32),
             jax.ShapeDtypeStruct((num_rows, padded_heads, slots), jnp.float32)])


def combine_splits(o, m, l, *, num_splits: int, num_heads: int, dtype, interpret: bool = False,
                   name: str = "mla_combine"):
    """Merge the partial results ``split_outputs`` allocates into ``[rows, num_heads, R]`` of
    ``dtype``: one program per (row, head)."""
    num_rows, _, slots, latent_dim = o.shape
    return pl.pallas_call(
        pdl.with_trigger(functools.partial(_combine_kernel, num_splits=num_splits), "decode_combine",
                         interpret=interpret),
        grid=(num_rows, num_heads),
        in_specs=[pl.BlockSpec((None, None, slots, latent_dim), lambda r, h: (r, h, 0, 0)),
                  pl.BlockSpec((None, None, slots), lambda r, h: (r, h, 0)),
                  pl.BlockSpec((None, None, slots), lambda r, h: (r, h, 0))],
        out_specs=pl.BlockSpec((None, None, latent_dim), lambda r, h: (r, h, 0)),
        out_shape=jax.ShapeDtypeStruct((num_rows, num_heads, latent_dim), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name=name,
    )(o, m, l)


__all__ = ["Blocking", "mla_paged_decode_attention", "plan_blocking", "supports"]
