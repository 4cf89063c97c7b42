"""Free lists of cache pages and state slots, one pool per data-parallel rank.

With ``D`` data-parallel ranks the cache arrays hold ``D`` equal pools side by side, each on its
rank's devices; a sequence runs on one rank and its page and slot ids count from 0 within that
rank's pool (the ids its block table and slot index hold). With one rank there is one pool.
"""

from __future__ import annotations


class OutOfPagesError(RuntimeError):
    """Raised by ``PageAllocator.allocate``; the scheduler answers it by preempting a request."""


class _Pools:
    """``ranks`` free lists of ``size`` ids each. Pop from the end: low ids are handed out first,
    which keeps small runs readable."""

    def __init__(self, size: int, ranks: int):
        if ranks < 1:
            raise ValueError(f"ranks must be positive, got {ranks}")
        self.ranks = ranks
        self._free = [list(range(size - 1, -1, -1)) for _ in range(ranks)]

    def num_free_on(self, rank: int) -> int:
        return len(self._free[rank])

    @property
    def num_free(self) -> int:
        """Free ids over every rank."""
        return sum(len(free) for free in self._free)


class PageAllocator(_Pools):
    """``num_pages`` pages per rank."""

    def __init__(self, num_pages: int, ranks: int = 1):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        super().__init__(num_pages, ranks)
        self.pages_per_rank = num_pages

    @property
    def num_pages(self) -> int:
        """Pages over every rank."""
        return self.pages_per_rank * self.ranks

    def can_allocate(self, n: int, rank: int = 0) -> bool:
        return n <= len(self._free[rank])

    def allocate(self, n: int, rank: int = 0) -> list[int]:
        free = self._free[rank]
        if n > len(free):
            raise OutOfPagesError(f"asked for {n} pages, {len(free)} free")
        pages = free[-n:] if n else []
        del free[len(free) - n:]
        return pages[::-1]

    def free(self, pages: list[int], rank: int = 0) -> None:
        self._free[rank].extend(reversed(pages))


class SlotAllocator(_Pools):
    """``num_slots`` state slots per rank, one per running sequence (for layers with per-sequence state).

    A slot is only an index: the sequence it is handed to starts from zero state (the step metadata
    marks it fresh), so nothing of the slot's previous owner is ever read.
    """

    def __init__(self, num_slots: int, ranks: int = 1):
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        super().__init__(num_slots, ranks)
        self.slots_per_rank = num_slots

    @property
    def num_slots(self) -> int:
        """Slots over every rank."""
        return self.slots_per_rank * self.ranks

    def allocate(self, rank: int = 0) -> int:
        free = self._free[rank]
        if not free:
            where = f" of rank {rank}" if self.ranks > 1 else ""
            raise OutOfPagesError(f"all {self.slots_per_rank} state slots{where} are in use")
        return free.pop()

    def free(self, slot: int | None, rank: int = 0) -> None:
        if slot is not None:
            self._free[rank].append(slot)
