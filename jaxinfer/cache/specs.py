"""What one layer keeps between steps, described once: a tuple of cache specs per layer.

A spec names the arrays it owns in the layer's cache (a dict of arrays), knows their shapes for a
given pool size, how they shard, and what they cost. Paged kinds hold one row per token in pages of
the shared page pool (a sequence's block table lists its pages, the same pages in every paged layer);
the state-slot kind holds a fixed-size state per running sequence in one slot of the slot pool.

Kinds:
* ``PagedKV``: K and V per KV head, ``[kv_heads, num_pages, page_size, head_dim]`` each (GQA/MQA
  attention; with ``sliding_window`` the layer only reads the last ``window`` positions).
* ``PagedLatent``: one latent row per token, ``[num_pages, page_size, latent_dim + rope_dim]``, no
  head axis (multi-head latent attention).
* ``PagedSide``: an extra per-token row a layer keeps beside its main cache, ``[num_pages, page_size,
  width]`` (e.g. a sparse-attention indexer's keys).
* ``StateSlots``: fixed-size per-sequence arrays, ``[num_slots, *shape]`` each (a linear-attention
  layer's recurrent and conv state); a slot handed to a new sequence starts from zeros.

A paged array whose spec leaves its dtype to the cache is stored in the KV cache dtype
(``kv_cache_dtype``: the compute dtype, or fp8 with a scale beside it, ``jaxinfer.cache.fp8``); the
arrays of state slots keep the compute dtype (or their own).

Each array declares the logical axis of each dimension (``jaxinfer.sharding.plan``); the plan maps
them to the mesh. The pool's pages (``PAGES``) and slots (``SLOTS``) are split over data-parallel
ranks: each rank's block tables and slot ids index its own part.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from jaxinfer.sharding.plan import KV_HEADS, PAGES, SLOTS


@dataclasses.dataclass(frozen=True)
class PoolSizes:
    """The sizes every spec's arrays are laid out for."""

    page_size: int
    num_pages: int
    num_slots: int = 0


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """Base of the kinds: ``arrays`` maps array name -> (shape, dtype or None for the cache dtype,
    the logical axis of each dimension: ``jaxinfer.sharding.plan``, None for a dimension every device
    holds whole)."""

    paged = True  # one row per token in the page pool (else: one slot per sequence)

    @property
    def kind(self) -> str:
        return type(self).__name__

    def arrays(self, sizes: PoolSizes) -> dict[str, tuple[tuple[int, ...], np.dtype | None, tuple]]:
        raise NotImplementedError

    def bytes_per_token(self, dtype) -> int:
        """Bytes one token costs (paged kinds; 0 for state slots)."""
        if not self.paged:
            return 0
        one_page = self.arrays(PoolSizes(page_size=1, num_pages=1))
        return sum(math.prod(shape) * np.dtype(own or dtype).itemsize for shape, own, _ in one_page.values())

    def bytes_per_sequence(self, dtype) -> int:
        """Bytes one sequence's slot costs (state slots; 0 for paged kinds)."""
        if self.paged:
            return 0
        one_slot = self.arrays(PoolSizes(page_size=1, num_pages=1, num_slots=1))
        return sum(math.prod(shape) * np.dtype(own or dtype).itemsize for shape, own, _ in one_slot.values())


@dataclasses.dataclass(frozen=True)
class PagedKV(CacheSpec):
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None

    def arrays(self, sizes):
        shape = (self.num_kv_heads, sizes.num_pages, sizes.page_size, self.head_dim)
        # Split by KV head, as the k/v projections that write them.
        axes = (KV_HEADS, PAGES, None, None)
        return {"k": (shape, None, axes), "v": (shape, None, axes)}


@dataclasses.dataclass(frozen=True)
class PagedLatent(CacheSpec):
    latent_dim: int
    rope_dim: int

    def arrays(self, sizes):
        # No head axis: every head reads the same latent rows, so tensor parallelism replicates them.
        return {"latent": ((sizes.num_pages, sizes.page_size, self.latent_dim + self.rope_dim), None,
                           (PAGES, None, None))}


@dataclasses.dataclass(frozen=True)
class PagedSide(CacheSpec):
    name: str
    width: int
    dtype: str | None = None  # None: the cache dtype

    def arrays(self, sizes):
        own = np.dtype(self.dtype) if self.dtype else None
        return {self.name: ((sizes.num_pages, sizes.page_size, self.width), own, (PAGES, None, None))}


@dataclasses.dataclass(frozen=True)
class StateSlots(CacheSpec):
    """``states``: (name, per-sequence shape, dtype, logical axes of that shape) per array, dtype None
    for the cache dtype (a conv state of recent inputs; recurrent state is float32); a layer split by
    head (``HEADS``) splits its state the same way."""

    states: tuple[tuple[str, tuple[int, ...], str | None, tuple], ...]

    paged = False

    def arrays(self, sizes):
        return {name: ((sizes.num_slots, *shape), np.dtype(dtype) if dtype else None, (SLOTS, *axes))
                for name, shape, dtype, axes in self.states}
