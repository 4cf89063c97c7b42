"""Sequences packed into one padded research forward whose shapes come from a few buckets.

Token rows are padded to a power of two (at least ``MIN_TOKENS``), sequences to a power of two, and
each sequence's pages to the power of two above the longest sequence (at least one page): a new
length within the same buckets reuses the compiled forward. Padding tokens belong to no sequence
and padding sequences bring no tokens (``jaxinfer.cache.metadata``), so neither changes a result
beyond float rounding (XLA may tile and sum in another order at another shape). Sequence ``s`` owns
pages ``[s * P, (s + 1) * P)`` and state slot ``s``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

PAGE_SIZE = 16
MIN_TOKENS = 16


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two that is at least ``n`` and ``minimum``."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Batch:
    """The padded forward's inputs (``token_ids [T]``, ``num_new [S]``, ``block_tables [S, P]``,
    ``state_slots [S]``) and where each sequence's rows are (``starts``, ``lengths``)."""

    token_ids: np.ndarray
    num_new: np.ndarray
    block_tables: np.ndarray
    state_slots: np.ndarray
    starts: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_keys(self) -> int:
        """Key positions each token's attention row spans."""
        return self.block_tables.shape[1] * PAGE_SIZE

    def rows(self, s: int) -> slice:
        return slice(self.starts[s], self.starts[s] + self.lengths[s])

    def first_slot(self, s: int) -> int:
        """Sequence ``s``'s first cache row: its position ``j`` is row ``first_slot(s) + j``."""
        return int(self.block_tables[s, 0]) * PAGE_SIZE


def pack(sequences: list[list[int]]) -> Batch:
    lengths = tuple(len(ids) for ids in sequences)
    starts = tuple(int(x) for x in np.cumsum((0,) + lengths[:-1]))
    num_tokens = bucket(sum(lengths), MIN_TOKENS)
    num_seqs = bucket(len(sequences))
    pages = bucket(max(lengths), PAGE_SIZE) // PAGE_SIZE
    token_ids = np.zeros(num_tokens, np.int32)
    token_ids[:sum(lengths)] = np.concatenate([np.asarray(ids, np.int32) for ids in sequences])
    num_new = np.zeros(num_seqs, np.int32)
    num_new[:len(lengths)] = lengths
    block_tables = np.arange(num_seqs * pages, dtype=np.int32).reshape(num_seqs, pages)
    return Batch(token_ids, num_new, block_tables, np.arange(num_seqs, dtype=np.int32), starts, lengths)


__all__ = ["Batch", "MIN_TOKENS", "PAGE_SIZE", "bucket", "pack"]
