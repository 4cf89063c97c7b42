"""The paged KV cache: its layout (described once), page allocation, and per-step metadata."""

from jaxinfer.cache.allocator import OutOfPagesError, PageAllocator
from jaxinfer.cache.layout import KVCacheLayout, KVCacheSpec
from jaxinfer.cache.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "KVCacheLayout", "KVCacheSpec", "OutOfPagesError", "PageAllocator"]
