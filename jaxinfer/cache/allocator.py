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
