"""The whole cache: every layer's specs (``jaxinfer.cache.specs``) laid out for one page pool and one
slot pool.

Layer ``i``'s cache is a dict of the arrays its specs name. All paged arrays share the page pool:
page ``p`` of a sequence is page ``p`` in every paged layer, listed once in the sequence's block
table. Every state-slot array has ``num_slots`` slots, one per running sequence. The allocator, the
scheduler, the runner, the ops and ``jaxinfer info`` all read sizes from here.

``kv_dtype`` is the paged arrays' dtype where their spec leaves it to the cache (``kv_cache_dtype``;
None: ``dtype``, the compute dtype, which state slots always keep). An fp8 paged array has a float32
scalar scale beside it, ``<array>_scale`` (``jaxinfer.cache.fp8``), allocated holding its value from
``kv_scales`` (1.0 where the checkpoint gives none) and never written by a step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxinfer.cache import fp8
from jaxinfer.cache.specs import CacheSpec, PoolSizes
from jaxinfer.sharding.plan import ShardingPlan


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    layer_specs: tuple[tuple[CacheSpec, ...], ...]
    page_size: int
    num_pages: int
    dtype: jnp.dtype
    num_slots: int = 0
    kv_dtype: jnp.dtype | None = None
    kv_scales: tuple[tuple[tuple[str, float], ...], ...] = ()  # per layer: (scale name, value), e.g. ("k_scale", 0.5)

    def __post_init__(self):
        for layer, specs in enumerate(self.layer_specs):
            names = [name for spec in specs for name in spec.arrays(self.sizes)]
            if len(names) != len(set(names)):
                raise ValueError(f"layer {layer}'s cache specs name an array twice: {names}")
        if self.kv_scales and len(self.kv_scales) != len(self.layer_specs):
            raise ValueError(f"kv_scales gives {len(self.kv_scales)} layers' scales for {len(self.layer_specs)} layers")

    @property
    def sizes(self) -> PoolSizes:
        return PoolSizes(self.page_size, self.num_pages, self.num_slots)

    # ---- sizes ---------------------------------------------------------------------------------

    @staticmethod
    def bytes_per_token_for(layer_specs, dtype, kv_dtype=None) -> int:
        """Bytes one token costs over all layers, paged arrays in ``kv_dtype`` (None: ``dtype``)."""
        return sum(spec.bytes_per_token(kv_dtype or dtype) for specs in layer_specs for spec in specs)

    @staticmethod
    def bytes_per_sequence_for(layer_specs, dtype) -> int:
        """Bytes of state one sequence's slot holds, over all layers."""
        return sum(spec.bytes_per_sequence(dtype) for specs in layer_specs for spec in specs)

    @staticmethod
    def needs_slots(layer_specs) -> bool:
        return any(not spec.paged for specs in layer_specs for spec in specs)

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token_for(self.layer_specs, self.dtype, self.kv_dtype) * self.page_size

    @property
    def bytes_per_slot(self) -> int:
        return self.bytes_per_sequence_for(self.layer_specs, self.dtype)

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_page * self.num_pages + self.bytes_per_slot * self.num_slots

    def bytes_by_kind(self) -> dict[str, tuple[int, int]]:
        """{spec kind: (bytes per token, bytes per sequence slot)} summed over the layers."""
        out: dict[str, tuple[int, int]] = {}
        for specs in self.layer_specs:
            for spec in specs:
                token, seq = out.get(spec.kind, (0, 0))
                out[spec.kind] = (token + spec.bytes_per_token(self.kv_dtype or self.dtype),
                                  seq + spec.bytes_per_sequence(self.dtype))
        return out

    # ---- arrays --------------------------------------------------------------------------------

    def layer_arrays(self, layer: int) -> dict[str, tuple[tuple[int, ...], np.dtype, tuple]]:
        """{array name: (shape, dtype, logical axes)} of layer ``layer``'s cache, each fp8 array's
        scale included."""
        out = {}
        for spec in self.layer_specs[layer]:
            default = (self.kv_dtype or self.dtype) if spec.paged else self.dtype
            for name, (shape, dtype, axes) in spec.arrays(self.sizes).items():
                out[name] = (shape, np.dtype(dtype or default), axes)
                if fp8.is_fp8(out[name][1]):
                    out[fp8.scale_name(name)] = ((), np.dtype(np.float32), ())
        return out

    def fill_values(self, layer: int) -> dict[str, float]:
        """What each array of layer ``layer``'s cache holds when allocated: 0, except the fp8 scales."""
        scales = dict(self.kv_scales[layer]) if self.kv_scales else {}
        arrays = self.layer_arrays(layer)
        scale_names = {fp8.scale_name(name) for name, (_, dtype, _) in arrays.items() if fp8.is_fp8(dtype)}
        return {name: scales.get(name, 1.0) if name in scale_names else 0.0 for name in arrays}

    def partition_specs(self, plan: ShardingPlan) -> list[dict[str, P]]:
        """Each cache array's ``PartitionSpec`` under ``plan``: one dict per layer."""
        return [{name: plan.spec(axes) for name, (_, _, axes) in self.layer_arrays(layer).items()}
                for layer in range(len(self.layer_specs))]

    def abstract(self, plan: ShardingPlan) -> list[dict[str, jax.ShapeDtypeStruct]]:
        """ShapeDtypeStructs of the caches, with their shardings under ``plan``: one dict per layer."""
        return [
            {name: jax.ShapeDtypeStruct(shape, dtype, sharding=plan.sharding(axes))
             for name, (shape, dtype, axes) in self.layer_arrays(layer).items()}
            for layer in range(len(self.layer_specs))
        ]

    def zeros(self) -> list[dict[str, jax.Array]]:
        """Unsharded empty caches (the research forward, ``jax.eval_shape`` of a model's init): zeros,
        and each fp8 array's scale (``fill_values``)."""
        out = []
        for layer in range(len(self.layer_specs)):
            fills = self.fill_values(layer)
            out.append({name: jnp.full(shape, fills[name], dtype)
                        for name, (shape, dtype, _) in self.layer_arrays(layer).items()})
        return out
