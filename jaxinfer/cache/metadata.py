"""What one model step needs to read and write its caches, and the one function that builds it.

A step runs ``T`` tokens (padded to a bucket) from ``S`` sequences (padded to a bucket). Sequence
``s`` brings ``query_start[s+1] - query_start[s]`` new tokens (``query_start`` is the cumulative
count, cu_seqlens), holds ``seq_lens[s]`` tokens once they are written, lists its pages in
``block_tables[s]`` and its state slot in ``state_slots[s]`` (-1: none), and ``fresh[s]`` says it
starts from an empty state (nothing cached yet). Token ``t`` belongs to sequence ``token_seq_ids[t]``,
sits at ``positions[t]`` in it, and its cache row is ``slot_mapping[t]`` (``page * page_size +
offset``). Padding tokens belong to no sequence: ``valid[t]`` is False, ``token_seq_ids[t]`` and
``slot_mapping[t]`` are -1 (a negative slot is never written). Token ``t`` attends to positions
``<= positions[t]`` of its sequence.

``decode`` (static) says every sequence brings at most one token, ``T == S`` and token ``s`` belongs
to sequence ``s`` (a finished row of a decode loop is padding); attention then takes the decode op.
``logits_indices[s]`` is the token row whose logits sequence ``s`` samples from (its last token).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import struct


@struct.dataclass
class StepMetadata:
    """One step's metadata, read by every mixer (attention, MLA, the linear-attention layers): the
    same on every device of a data-parallel rank; each rank holds its own rows
    (``build_ranks_metadata``)."""

    positions: jax.Array  # [T] int32
    slot_mapping: jax.Array  # [T] int32, -1 for padding
    token_seq_ids: jax.Array  # [T] int32, -1 for padding
    block_tables: jax.Array  # [S, pages_per_seq] int32
    seq_lens: jax.Array  # [S] int32
    logits_indices: jax.Array  # [S] int32
    valid: jax.Array | None = None  # [T] bool
    query_start: jax.Array | None = None  # [S + 1] int32
    state_slots: jax.Array | None = None  # [S] int32, -1: none
    fresh: jax.Array | None = None  # [S] bool
    decode: bool = struct.field(pytree_node=False, default=False)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def build_metadata(num_computed, num_new, block_tables, *, page_size: int, num_tokens: int, state_slots=None,
                   decode: bool = False, xp=np) -> StepMetadata:
    """The step's metadata from per-sequence arrays; ``xp`` is ``numpy`` on the host or
    ``jax.numpy`` on the device (the decode loop, a traced forward), with the same result.

    ``num_computed [S]``: tokens each sequence has cached before this step; ``num_new [S]``: the
    tokens it brings (0 for a padding sequence, or a finished row of a decode loop);
    ``block_tables [S, P]``; ``state_slots [S]`` or None. Sequence ``s``'s new tokens are the token
    rows ``query_start[s]`` to ``query_start[s+1]``, except with ``decode``, where row ``s`` is
    sequence ``s``'s token.
    """
    int32 = xp.int32
    num_computed = xp.asarray(num_computed, int32)
    num_new = xp.asarray(num_new, int32)
    block_tables = xp.asarray(block_tables, int32)
    num_seqs = num_computed.shape[0]
    rows = xp.arange(num_tokens, dtype=int32)
    if decode:  # row s is sequence s's one token: no gathers through a token -> sequence map
        if num_tokens != num_seqs:
            raise ValueError(f"a decode step has one token row per sequence: {num_tokens} rows, {num_seqs} sequences")
        query_start = xp.arange(num_seqs + 1, dtype=int32)
        valid = num_new > 0
        seq = rows
        positions = xp.where(valid, num_computed, 0).astype(int32)
        page = xp.take_along_axis(block_tables, (positions // page_size)[:, None], axis=1)[:, 0]
    else:
        query_start = xp.concatenate([xp.zeros((1,), int32), xp.cumsum(num_new).astype(int32)])
        valid = rows < query_start[-1]
        seq = xp.minimum(xp.searchsorted(query_start[1:], rows, side="right"), num_seqs - 1).astype(int32)
        positions = xp.where(valid, num_computed[seq] + rows - query_start[seq], 0).astype(int32)
        page = block_tables[seq, positions // page_size]  # one entry per token, not a copy of its table row
    slot_mapping = xp.where(valid, page * page_size + positions % page_size, -1).astype(int32)
    seq_lens = xp.where(num_new > 0, num_computed + num_new, 0).astype(int32)
    logits_indices = rows if decode else xp.maximum(query_start[1:] - 1, 0).astype(int32)
    if state_slots is not None:
        state_slots = xp.asarray(state_slots, int32)
    return StepMetadata(
        positions=positions, slot_mapping=slot_mapping, token_seq_ids=xp.where(valid, seq, -1).astype(int32),
        block_tables=block_tables, seq_lens=seq_lens, logits_indices=logits_indices,
        valid=valid, query_start=query_start, state_slots=state_slots, fresh=(num_computed == 0) & (num_new > 0),
        decode=decode,
    )


def build_ranks_metadata(ranks: int, num_computed, num_new, block_tables, *, page_size: int, num_tokens: int,
                         state_slots=None, decode: bool = False, xp=np) -> StepMetadata:
    """The metadata of a step of ``ranks`` data-parallel ranks side by side: every per-sequence array
    holds ``ranks`` equal parts (rank ``r``'s sequences), ``num_tokens`` is one rank's token rows.
    Each rank's metadata is ``build_metadata``'s for its own part (token rows, pages and slots
    counted from 0 in the rank), and each field is the ranks' fields end to end, so that splitting
    every field into ``ranks`` equal parts gives each rank its own."""
    if ranks == 1:
        return build_metadata(num_computed, num_new, block_tables, page_size=page_size, num_tokens=num_tokens,
                              state_slots=state_slots, decode=decode, xp=xp)
    seqs = num_computed.shape[0] // ranks
    part = lambda a, r: None if a is None else a[r * seqs:(r + 1) * seqs]  # noqa: E731
    parts = [build_metadata(part(num_computed, r), part(num_new, r), part(block_tables, r), page_size=page_size,
                            num_tokens=num_tokens, state_slots=part(state_slots, r), decode=decode, xp=xp)
             for r in range(ranks)]
    return jax.tree.map(lambda *fields: xp.concatenate(fields), *parts)
