"""The cache described once: one ``KVCacheSpec`` per layer, grouped by kind.

Every attention layer of the dense families keeps K and V pages of the same geometry, so all layers
share one page pool and one block table per sequence (page ``p`` of a sequence is page ``p`` in
every layer). Sliding-window layers are a separate group so that a later allocator can free pages
that slid out of the window; today they keep all their pages, which is correct, only not minimal.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    kind: str  # "full_attention" | "sliding_attention"
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None


@dataclasses.dataclass(frozen=True)
class KVCacheLayout:
    """K/V pages of shape ``[num_kv_heads, num_pages, page_size, head_dim]`` per layer.

    Head-major: one KV head's pages are one contiguous array, so an attention kernel program that
    serves one KV head indexes pages of that array directly.
    """

    layer_specs: tuple[KVCacheSpec, ...]
    page_size: int
    num_pages: int
    dtype: jnp.dtype

    def groups(self) -> dict[KVCacheSpec, list[int]]:
        out: dict[KVCacheSpec, list[int]] = {}
        for layer, spec in enumerate(self.layer_specs):
            out.setdefault(spec, []).append(layer)
        return out

    @staticmethod
    def bytes_per_page_for(layer_specs, page_size: int, dtype) -> int:
        itemsize = np.dtype(dtype).itemsize
        return sum(2 * page_size * s.num_kv_heads * s.head_dim * itemsize for s in layer_specs)

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_page_for(self.layer_specs, self.page_size, self.dtype)

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_page * self.num_pages

    def page_shape(self, spec: KVCacheSpec) -> tuple[int, ...]:
        return (spec.num_kv_heads, self.num_pages, self.page_size, spec.head_dim)

    def sharding(self, mesh: Mesh) -> NamedSharding:
        # KV heads split over the tensor-parallel axis, like the attention heads that write them.
        return NamedSharding(mesh, P("model", None, None, None))

    def abstract(self, mesh: Mesh):
        """ShapeDtypeStructs of the caches: a list, one ``(k, v)`` pair per layer."""
        sharding = self.sharding(mesh)
        return [
            tuple(jax.ShapeDtypeStruct(self.page_shape(s), self.dtype, sharding=sharding) for _ in "kv")
            for s in self.layer_specs
        ]

    def allocate(self, mesh: Mesh):
        """Zero-filled caches (zeros, so stale or unused pages can never hold NaNs)."""
        sharding = self.sharding(mesh)
        zeros = jax.jit(lambda shape: jnp.zeros(shape, self.dtype), static_argnums=0, out_shardings=sharding)
        return [(zeros(self.page_shape(s)), zeros(self.page_shape(s))) for s in self.layer_specs]
