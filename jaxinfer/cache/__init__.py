"""The cache: per-layer specs (``specs``), their layout over one page pool and one slot pool
(``layout``), page and slot allocation (``allocator``), and per-step metadata (``metadata``)."""

from jaxinfer.cache.allocator import OutOfPagesError, PageAllocator, SlotAllocator
from jaxinfer.cache.layout import CacheLayout
from jaxinfer.cache.metadata import StepMetadata
from jaxinfer.cache.specs import CacheSpec, PagedKV, PagedLatent, PagedSide, PoolSizes, StateSlots

__all__ = ["StepMetadata", "CacheLayout", "CacheSpec", "OutOfPagesError", "PageAllocator", "PagedKV",
           "PagedLatent", "PagedSide", "PoolSizes", "SlotAllocator", "StateSlots"]
