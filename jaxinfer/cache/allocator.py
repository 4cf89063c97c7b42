"""A free list of cache pages."""

from __future__ import annotations


class OutOfPagesError(RuntimeError):
    """Raised by ``PageAllocator.allocate``; the scheduler answers it by preempting a request."""


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        # Pop from the end: low page ids are handed out first, which keeps small runs readable.
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free")
        pages = self._free[-n:] if n else []
        del self._free[len(self._free) - n :]
        return pages[::-1]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


class SlotAllocator:
    """A free list of state slots, one per running sequence (for layers with per-sequence state).

    A slot is only an index: the sequence it is handed to starts from zero state (the step metadata
    marks it fresh), so nothing of the slot's previous owner is ever read.
    """

    def __init__(self, num_slots: int):
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfPagesError(f"all {self.num_slots} state slots are in use")
        return self._free.pop()

    def free(self, slot: int | None) -> None:
        if slot is not None:
            self._free.append(slot)
