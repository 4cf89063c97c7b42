"""Continuous batching: which requests run in the next device call, and with how many tokens.

Each call is either
* a **mixed step** (``MixedBatch``) when any request has more than one token to compute (a new or
  partially prefilled prompt, or a recompute after preemption): every running decode request
  brings its one token, and prompts are chunked into the remaining token budget (chunked prefill);
* or a **decode loop** (``DecodeBatch``) of ``decode_steps`` steps on the device for all running
  requests, when every one of them is decoding.

Pages are allocated before the call for every token it may write. When the pool runs dry the
newest running request is preempted (pages and state slot freed, recomputed later from its tokens);
no request is ever dropped. New requests are admitted first-come first-served while sequence slots,
pages and (for models with per-sequence state) state slots last. Where every paged layer reads only
a sliding window, a sequence's pages that slid out of it go back to the pool before each step, so
a sequence holds a bounded number of pages however long it grows.

With data-parallel ranks (``PageAllocator.ranks > 1``) every rank has its own pages, state slots,
``max_num_seqs`` sequences and ``max_num_batched_tokens`` tokens per step, as one engine each would;
a request is admitted to the rank with the fewest running sequences that has room for it (most free
pages first among equals), and preemption frees pages on the rank that needs them. All ranks run
the same kind of call in a step.
"""

from __future__ import annotations

import collections
import dataclasses

from jaxinfer.cache.allocator import PageAllocator, SlotAllocator
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.request import Request, RequestStatus


@dataclasses.dataclass
class MixedBatch:
    items: list[tuple[Request, int]]  # (request, tokens computed this step), in row order

    @property
    def most_tokens_on_a_rank(self) -> int:
        """The tokens of the rank that computes the most (each rank's token rows are padded to it)."""
        per_rank = collections.Counter()
        for request, n in self.items:
            per_rank[request.rank] += n
        return max(per_rank.values(), default=0)


@dataclasses.dataclass
class DecodeBatch:
    requests: list[Request]
    num_steps: int

    @property
    def most_seqs_on_a_rank(self) -> int:
        return max(collections.Counter(r.rank for r in self.requests).values(), default=0)


def rank_rows(requests: list[Request], seqs_per_rank: int) -> list[int]:
    """Each request's sequence row in a step whose rank ``r`` holds rows ``[r * seqs_per_rank, (r + 1)
    * seqs_per_rank)``, the requests of one rank in their order."""
    used = collections.Counter()
    rows = []
    for request in requests:
        rows.append(request.rank * seqs_per_rank + used[request.rank])
        used[request.rank] += 1
    return rows


class Scheduler:
    """``window``: the sliding window every paged layer reads within, or None when some layer reads
    its whole context (pages then live as long as their sequence)."""

    def __init__(self, config: EngineConfig, allocator: PageAllocator, slots: SlotAllocator | None = None,
                 window: int | None = None):
        self.config = config
        self.allocator = allocator
        self.slots = slots  # None: the model keeps no per-sequence state
        self.window = window
        self.ranks = allocator.ranks
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages_needed(self, request: Request, num_tokens_in_cache: int) -> int:
        return max(0, -(-num_tokens_in_cache // self.config.page_size) - len(request.pages))

    def _try_grow(self, request: Request, num_tokens_in_cache: int) -> bool:
        need = self._pages_needed(request, num_tokens_in_cache)
        if not self.allocator.can_allocate(need, request.rank):
            return False
        request.pages.extend(self.allocator.allocate(need, request.rank))
        return True

    def _release(self, request: Request) -> None:
        self.allocator.free(request.pages[request.num_released_pages:], request.rank)
        request.pages = []
        request.num_released_pages = 0
        if self.slots is not None:
            self.slots.free(request.slot, request.rank)
        request.slot = None

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.num_computed = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.running.remove(request)
        self.waiting.appendleft(request)

    def _grow_or_preempt(self, request: Request, num_tokens_in_cache: int) -> bool:
        """Make room for ``request`` by preempting newer requests of its rank; False if it was preempted
        itself."""
        while not self._try_grow(request, num_tokens_in_cache):
            victim = [r for r in self.running if r.rank == request.rank][-1]
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def finish(self, request: Request, reason: str) -> None:
        """End ``request`` (running or waiting) with ``reason``; its pages and slot go back to the pools."""
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def find(self, request_id: int) -> Request | None:
        """The unfinished request with this id, if any."""
        return next((r for r in (*self.running, *self.waiting) if r.request_id == request_id), None)

    def preempt_all(self) -> None:
        """Send every running request back to be recomputed (the cache lost what they had written)."""
        for request in reversed(list(self.running)):
            self._preempt(request)

    def _release_slid_out(self, request: Request) -> None:
        """Give back the leading pages no later token can see: a query at position ``>= num_computed``
        reads keys after ``position - window``, so page ``p`` is dead once ``(p + 1) * page_size <=
        num_computed - window + 1``. Its block-table entry stays (attention masks it out)."""
        dead = max(0, (request.num_computed - self.window + 1) // self.config.page_size)
        dead = min(dead, len(request.pages))
        if dead > request.num_released_pages:
            self.allocator.free(request.pages[request.num_released_pages:dead], request.rank)
            request.num_released_pages = dead

    def schedule(self) -> MixedBatch | DecodeBatch | None:
        if not self.has_work():
            return None
        if self.window is not None:
            for request in self.running:
                self._release_slid_out(request)
        if any(r.num_pending > 1 for r in self.running) or self._can_admit():
            return self._schedule_mixed()
        return self._schedule_decode()

    def _rank_for(self, request: Request, budgets: list[int]) -> int | None:
        """The rank to admit ``request`` to in a step that leaves ``budgets`` tokens per rank: one with
        a free sequence row and state slot, budget left, and the pages of its first chunk (the fewest
        running sequences first, then the most free pages); None when no rank has room."""
        running = collections.Counter(r.rank for r in self.running)
        fits = [rank for rank in range(self.ranks)
                if budgets[rank] > 0 and running[rank] < self.config.max_num_seqs
                and (self.slots is None or self.slots.num_free_on(rank) > 0)
                and self.allocator.can_allocate(self._pages_needed(request, min(request.num_pending, budgets[rank])),
                                                rank)]
        return min(fits, key=lambda rank: (running[rank], -self.allocator.num_free_on(rank)), default=None)

    def _can_admit(self) -> bool:
        if not self.waiting:
            return False
        return self._rank_for(self.waiting[0], [self.config.max_num_batched_tokens] * self.ranks) is not None

    def _schedule_mixed(self) -> MixedBatch:
        budgets = [self.config.max_num_batched_tokens] * self.ranks
        items: list[tuple[Request, int]] = []
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or budgets[request.rank] == 0:
                continue  # preempted while making room for an earlier one, or no budget left
            n = min(request.num_pending, budgets[request.rank])
            if self._grow_or_preempt(request, request.num_computed + n):
                items.append((request, n))
                budgets[request.rank] -= n
        while self.waiting:
            request = self.waiting[0]
            rank = self._rank_for(request, budgets)
            if rank is None:
                break
            request.rank = rank
            n = min(request.num_pending, budgets[rank])
            self._try_grow(request, request.num_computed + n)  # the pages _rank_for found
            self.waiting.popleft()
            if self.slots is not None:
                request.slot = self.slots.allocate(rank)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            items.append((request, n))
            budgets[rank] -= n
        return MixedBatch(items)

    def _schedule_decode(self) -> DecodeBatch:
        steps = self.config.decode_steps
        for request in list(self.running):
            if request.status is RequestStatus.RUNNING:
                # The loop writes at most min(steps, remaining_output) tokens of this request.
                self._grow_or_preempt(request, request.num_computed + min(steps, request.remaining_output))
        if not self.running:  # everything was preempted: start over with recompute
            return self._schedule_mixed()
        return DecodeBatch(list(self.running), steps)
