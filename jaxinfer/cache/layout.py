"""The whole cache: every layer's specs (``jaxinfer.cache.specs``) laid out for one page pool and one
slot pool.

Layer ``i``'s cache is a dict of the arrays its specs name. All paged arrays share the page pool:
page ``p`` of a sequence is page ``p`` in every paged layer, listed once in the sequence's block
table. Every state-slot array has ``num_slots`` slots, one per running sequence. The allocator, the
scheduler, the runner, the ops and ``jaxinfer info`` all read sizes from here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxinfer.cache.specs import CacheSpec, PoolSizes
from jaxinfer.sharding.plan import ShardingPlan


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    layer_specs: tuple[tuple[CacheSpec, ...], ...]
    page_size: int
    num_pages: int
    dtype: jnp.dtype
    num_slots: int = 0

    def __post_init__(self):
        for layer, specs in enumerate(self.layer_specs):
            names = [name for spec in specs for name in spec.arrays(self.sizes)]
            if len(names) != len(set(names)):
                raise ValueError(f"layer {layer}'s cache specs name an array twice: {names}")

    @property
    def sizes(self) -> PoolSizes:
        return PoolSizes(self.page_size, self.num_pages, self.num_slots)

    # ---- sizes ---------------------------------------------------------------------------------

    @staticmethod
    def bytes_per_token_for(layer_specs, dtype) -> int:
        return sum(spec.bytes_per_token(dtype) for specs in layer_specs for spec in specs)

    @staticmethod
    def bytes_per_sequence_for(layer_specs, dtype) -> int:
        """Bytes of state one sequence's slot holds, over all layers."""
        return sum(spec.bytes_per_sequence(dtype) for specs in layer_specs for spec in specs)

    @staticmethod
    def needs_slots(layer_specs) -> bool:
        return any(not spec.paged for specs in layer_specs for spec in specs)

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token_for(self.layer_specs, self.dtype) * self.page_size

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
                out[spec.kind] = (token + spec.bytes_per_token(self.dtype), seq + spec.bytes_per_sequence(self.dtype))
        return out

    # ---- arrays --------------------------------------------------------------------------------

    def layer_arrays(self, layer: int) -> dict[str, tuple[tuple[int, ...], np.dtype, tuple]]:
        """{array name: (shape, dtype, logical axes)} of layer ``layer``'s cache."""
        out = {}
        for spec in self.layer_specs[layer]:
            for name, (shape, dtype, axes) in spec.arrays(self.sizes).items():
                out[name] = (shape, np.dtype(dtype or self.dtype), axes)
        return out

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
        """Unsharded zero caches (the research forward, ``jax.eval_shape`` of a model's init)."""
        return [{name: jnp.zeros(shape, dtype) for name, (shape, dtype, _) in self.layer_arrays(layer).items()}
                for layer in range(len(self.layer_specs))]
