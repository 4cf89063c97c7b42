"""Grouping of a MoE call's (token, slot) pairs by expert into padded row blocks, in plain jnp.

The grouped-GEMM kernels (``grouped_pallas.py``) take their rows in *row blocks* of ``block_m``
consecutive padded rows, each block holding one expert's pairs. ``Grouping`` says which pair sits in
which row and which expert owns which block. ``group_by_expert`` is the reference form (a stable
sort); ``grouping_pallas.py`` computes the same arrays in two kernel launches for prefill, and the
decode-sized forms here avoid the sort altogether.

A pair whose expert id lies outside ``[0, E)`` is *dropped* (expert parallelism: another device's
expert): it takes no row, its ``pair_row`` is -1, and no block is made for it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def num_row_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on the row blocks in use: sum over touched experts of ``cdiv(n_e, block_m)``."""
    touched = min(num_experts, num_pairs)
    return max(1, (num_pairs + touched * (block_m - 1)) // block_m)


class Grouping(NamedTuple):
    row_pair: jax.Array  # [NB * block_m] int32: the flat (token * k + slot) of each padded row, -1 padding
    block_expert: jax.Array  # [NB] int32: the expert of each row block, -1 for unused blocks
    pair_row: jax.Array  # [T * k] int32: the padded row of each (token, slot), -1 for a dropped pair


def kept_ids(expert_ids, num_experts: int):
    """Flat ``[T * k]`` ids with every id outside ``[0, num_experts)`` made -1 (dropped)."""
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    return jnp.where((flat >= 0) & (flat < num_experts), flat, -1)


def group_by_expert(expert_ids, num_experts: int, block_m: int) -> Grouping:
    """Sort the (token, slot) pairs by expert, each expert's group padded to whole ``block_m`` blocks;
    dropped pairs sort after every group and take no row."""
    flat = kept_ids(expert_ids, num_experts)
    key = jnp.where(flat >= 0, flat, num_experts)  # bincount counts negative ids as expert 0; E it drops
    n = flat.shape[0]
    nb = num_row_blocks(n, num_experts, block_m)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sizes = jnp.bincount(key, length=num_experts).astype(jnp.int32)
    blocks = (sizes + block_m - 1) // block_m
    block_end = jnp.cumsum(blocks)
    first_row = (block_end - blocks) * block_m  # each group starts on a block boundary
    first_pair = jnp.cumsum(sizes) - sizes  # each group's start in the sorted order
    sorted_key = key[order]
    expert = jnp.minimum(sorted_key, num_experts - 1)
    dest = first_row[expert] + jnp.arange(n, dtype=jnp.int32) - first_pair[expert]
    dest = jnp.where(sorted_key < num_experts, dest, -1)
    pair_row = jnp.zeros((n,), jnp.int32).at[order].set(dest)
    row_pair = jnp.full((nb * block_m,), -1, jnp.int32).at[jnp.where(dest >= 0, dest, nb * block_m)].set(
        order, mode="drop")
    # One fused comparison, not the default binary-search scan (a serial loop of tiny kernels on GPU).
    block_expert = jnp.searchsorted(block_end, jnp.arange(nb, dtype=jnp.int32), side="right",
                                    method="compare_all").astype(jnp.int32)
    block_expert = jnp.where(block_expert < num_experts, block_expert, -1)
    return Grouping(row_pair, block_expert, pair_row)


def group_one_token(expert_ids, block_m: int, num_experts: int) -> Grouping:
    """One token: its ``k`` distinct experts each take one row block, in slot order (index arithmetic
    only; the kernels do not need the blocks sorted by expert). A dropped slot's block has expert -1."""
    flat = kept_ids(expert_ids, num_experts)
    slot = jnp.arange(flat.shape[0], dtype=jnp.int32)
    row = jnp.arange(flat.shape[0] * block_m, dtype=jnp.int32)
    return Grouping(jnp.where(row % block_m == 0, row // block_m, -1), flat,
                    jnp.where(flat >= 0, slot * block_m, -1))


def group_few_by_expert(expert_ids, num_experts: int, block_m: int) -> Grouping:
    """``group_by_expert`` for decode-sized steps, where no expert gets more than ``block_m`` rows.

    Same result (blocks in expert order, rows in pair order) from pairwise comparisons of the
    ``N <= DECODE_ROWS`` pairs instead of a sort and scans: a few fused kernels instead of a dozen
    small ones, which at one token cost more than the expert weights take to read.
    """
    flat = kept_ids(expert_ids, num_experts)
    kept = flat >= 0
    n = flat.shape[0]
    nb = num_row_blocks(n, num_experts, block_m)
    pair = jnp.arange(n, dtype=jnp.int32)
    same = (flat[:, None] == flat[None, :]) & kept[None, :]
    rank = (same & (pair[None, :] < pair[:, None])).sum(axis=1).astype(jnp.int32)  # row in the block
    first = kept & (rank == 0)  # the first pair of its expert
    block = (first[None, :] & (flat[None, :] < flat[:, None])).sum(axis=1).astype(jnp.int32)
    pair_row = jnp.where(kept, block * block_m + rank, -1)
    row = jnp.arange(nb * block_m, dtype=jnp.int32)
    row_pair = jnp.where(pair_row[None, :] == row[:, None], pair[None, :] + 1, 0).sum(axis=1) - 1
    b = jnp.arange(nb, dtype=jnp.int32)
    owner = first[None, :] & (block[None, :] == b[:, None])
    block_expert = jnp.where(owner, flat[None, :] + 1, 0).sum(axis=1) - 1
    return Grouping(row_pair.astype(jnp.int32), block_expert.astype(jnp.int32), pair_row)


__all__ = ["Grouping", "group_by_expert", "group_few_by_expert", "group_one_token", "kept_ids", "num_row_blocks"]
