"""Prefill grouping of (token, slot) pairs by expert in two Pallas launches (Triton lowering).

Same result as ``grouping.group_by_expert`` (the jnp form, a stable sort): pairs in stable
expert order, each expert's group padded to whole ``block_m`` row blocks, dropped pairs (ids outside
``[0, E)``, made -1 first) in none. The jnp form is a radix
sort plus 14 small XLA kernels; these two launches take a fraction of their time (docs/performance.md,
"MoE prefill grouping kernels"). The pairs are cut into chunks of ``chunk`` consecutive pairs and:

1. **count** (one program per chunk): each chunk's per-expert counts ``[C, E]``; each program also
   writes ``-1`` over its share of the padded-row array (the padding marker).
2. **place** (one program per chunk): each program sums the counts of all chunks (an expert's load)
   and of the chunks before its own, turns the loads into block offsets (a cumulative sum over
   experts), and places its pairs: padded row = the expert's first row + the expert's pairs in
   earlier chunks + its pairs earlier in this chunk (a cumulative sum of the one-hot rows). That is
   the stable order. It scatters each pair into its row and writes each block's expert. Dropped
   pairs match no expert: their ``pair_row`` is -1 and their scatter lanes write a spare row past
   the padded rows, cut off at the end.

Every tensor a program holds is a power-of-two tile of at most ``_TILE_ELEMENTS`` elements; experts
are padded to a power of two inside the kernels (their counts are 0). Each place program reads the
counts of every chunk, so that kernel's L2 traffic grows with the square of the chunk count: 256
chunks (4096 tokens x top-8, 128 experts) read 32 MB; at many times that, a separate prefix sum
over the chunks would be the cheaper form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.kernels.moe.grouping import Grouping, kept_ids, num_row_blocks

_TILE_ELEMENTS = 16384  # elements per [rows, experts] tile: 128 per thread at 4 warps
_FILL = 1024  # padded rows one loop step of the count kernel marks -1


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _layout(num_pairs: int, num_experts: int) -> tuple[int, int, int]:
    """(padded experts, pairs per chunk, chunks)."""
    experts_pad = max(16, _next_pow2(num_experts))
    chunk = max(16, min(256, _TILE_ELEMENTS // experts_pad))
    return experts_pad, chunk, -(-num_pairs // chunk)


def _count_kernel(ids_ref, counts_ref, row_pair_ref, *, chunk: int, experts_pad: int, num_chunks: int):
    num_pairs = ids_ref.shape[0]
    c = pl.program_id(0)
    pair = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
    ids = plgpu.load(ids_ref.at[pl.ds(c * chunk, chunk)], mask=pair < num_pairs, other=-1)
    expert = lax.broadcasted_iota(jnp.int32, (chunk, experts_pad), 1)
    counts_ref[...] = jnp.sum((ids[:, None] == expert).astype(jnp.int32), axis=0)

    # Mark this program's share of the padded rows (and the spare row) as padding (-1); the place
    # kernel overwrites the real ones. Pieces c, c + C, c + 2C, ... of _FILL rows.
    num_rows = row_pair_ref.shape[0]
    pieces = -(-num_rows // _FILL)

    def fill(i, carry):
        start = (c + i * num_chunks) * _FILL
        row = start + jnp.arange(_FILL, dtype=jnp.int32)
        plgpu.store(row_pair_ref.at[pl.ds(start, _FILL)], jnp.full((_FILL,), -1, jnp.int32), mask=row < num_rows)
        return carry

    lax.fori_loop(0, -(-pieces // num_chunks), fill, 0)


def _place_kernel(ids_ref, counts_ref, row_pair_in_ref, pair_row_ref, row_pair_ref, block_expert_ref, *,
                  chunk: int, experts_pad: int, num_chunks: int, num_experts: int, block_m: int):
    del row_pair_in_ref  # the same buffer as row_pair_ref (aliased): the -1 padding markers
    num_pairs = ids_ref.shape[0]
    c = pl.program_id(0)

    # Loads of all chunks (totals) and of the chunks before this one, a tile of counts at a time.
    step = max(1, min(_next_pow2(num_chunks), _TILE_ELEMENTS // experts_pad))

    def add_counts(i, carry):
        total, before = carry
        rows = i * step + lax.broadcasted_iota(jnp.int32, (step, experts_pad), 0)
        cols = lax.broadcasted_iota(jnp.int32, (step, experts_pad), 1)
        counts = plgpu.load(counts_ref.at[jnp.minimum(rows, num_chunks - 1), cols], mask=rows < num_chunks, other=0)
        return total + counts.sum(axis=0), before + jnp.where(rows < c, counts, 0).sum(axis=0)

    zeros = jnp.zeros((experts_pad,), jnp.int32)
    total, before = lax.fori_loop(0, -(-num_chunks // step), add_counts, (zeros, zeros))
    blocks = (total + block_m - 1) // block_m
    block_end = jnp.cumsum(blocks)  # [E_pad]: one past each expert's last block
    first_row = (block_end - blocks) * block_m

    # This chunk's pairs: padded row = expert's first row + its pairs in earlier chunks + its pairs
    # earlier in this chunk.
    pair = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
    in_range = pair < num_pairs
    ids = plgpu.load(ids_ref.at[pl.ds(c * chunk, chunk)], mask=in_range, other=-1)
    kept = ids >= 0
    one_hot = ids[:, None] == lax.broadcasted_iota(jnp.int32, (chunk, experts_pad), 1)
    earlier_in_chunk = jnp.cumsum(one_hot.astype(jnp.int32), axis=0) - 1  # at each pair's own expert
    start = (first_row + before)[None, :]
    dest = jnp.sum(jnp.where(one_hot, start + earlier_in_chunk, 0), axis=1)
    plgpu.store(pair_row_ref.at[pl.ds(c * chunk, chunk)], jnp.where(kept, dest, -1), mask=in_range)
    # The scatter, unmasked: lanes past the last pair and dropped pairs write the spare last row
    # (never read), which is harmless on the GPU and in interpret mode alike (a masked scatter there
    # writes the old value back, racing the real store when indices repeat).
    spare = row_pair_ref.shape[0] - 1
    plgpu.store(row_pair_ref.at[jnp.where(kept, dest, spare)], jnp.where(kept, pair, -1))

    # Each row block's expert: the number of experts whose blocks end at or before it (-1 past the
    # last used block). Tiles c, c + C, ... of the blocks.
    num_blocks = block_expert_ref.shape[0]
    tile = max(1, min(_next_pow2(num_blocks), _TILE_ELEMENTS // experts_pad))
    tiles = -(-num_blocks // tile)

    def expert_of_blocks(i, carry):
        start = (c + i * num_chunks) * tile
        b = start + jnp.arange(tile, dtype=jnp.int32)
        expert = jnp.sum((block_end[None, :] <= b[:, None]).astype(jnp.int32), axis=1)
        expert = jnp.where(expert < num_experts, expert, -1)
        plgpu.store(block_expert_ref.at[pl.ds(start, tile)], expert, mask=b < num_blocks)
        return carry

    lax.fori_loop(0, -(-tiles // num_chunks), expert_of_blocks, 0)


@functools.partial(jax.jit, static_argnames=("num_experts", "block_m", "interpret"))
def group_by_expert(expert_ids, num_experts: int, block_m: int, *, interpret: bool = False) -> Grouping:
    """``grouping.group_by_expert`` in two launches (ids outside ``[0, E)`` dropped)."""
    flat = kept_ids(expert_ids, num_experts)
    num_pairs = flat.shape[0]
    num_blocks = num_row_blocks(num_pairs, num_experts, block_m)
    experts_pad, chunk, num_chunks = _layout(num_pairs, num_experts)
    whole = lambda shape: pl.BlockSpec(shape, lambda c: (0,) * len(shape))  # noqa: E731
    statics = dict(chunk=chunk, experts_pad=experts_pad, num_chunks=num_chunks)

    counts, row_pair = pl.pallas_call(
        functools.partial(_count_kernel, **statics),
        grid=(num_chunks,),
        in_specs=[whole((num_pairs,))],
        out_specs=[pl.BlockSpec((None, experts_pad), lambda c: (c, 0)), whole((num_blocks * block_m + 1,))],
        out_shape=[jax.ShapeDtypeStruct((num_chunks, experts_pad), jnp.int32),
                   jax.ShapeDtypeStruct((num_blocks * block_m + 1,), jnp.int32)],  # + the spare row
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="moe_group_count",
    )(flat)
    pair_row, row_pair, block_expert = pl.pallas_call(
        functools.partial(_place_kernel, **statics, num_experts=num_experts, block_m=block_m),
        grid=(num_chunks,),
        in_specs=[whole((num_pairs,)), whole((num_chunks, experts_pad)), whole(row_pair.shape)],
        out_specs=[whole((num_pairs,)), whole(row_pair.shape), whole((num_blocks,))],
        out_shape=[jax.ShapeDtypeStruct((num_pairs,), jnp.int32), jax.ShapeDtypeStruct(row_pair.shape, jnp.int32),
                   jax.ShapeDtypeStruct((num_blocks,), jnp.int32)],
        input_output_aliases={2: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="moe_group_place",
    )(flat, counts, row_pair)
    return Grouping(row_pair[:-1], block_expert, pair_row)


__all__ = ["group_by_expert"]
