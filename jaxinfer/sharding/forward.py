"""A model's forward on each device's pieces: ``shard_map`` over the plan's mesh, with the layers in
the local view (``jaxinfer.sharding.local``). Every op inside, kernels included, sees local shapes and
runs on its own device; the layers combine pieces with explicit collectives. Nothing is left for XLA's
partitioner to split, so no custom call is ever gathered onto every device."""

from __future__ import annotations

from typing import Callable

import jax
from flax import traverse_util
from jax.sharding import PartitionSpec as P

from jaxinfer.quantization import QUANTIZED_WEIGHTS, spec_of
from jaxinfer.sharding.local import local_view
from jaxinfer.sharding.plan import ShardingPlan


def param_specs(plan: ShardingPlan, param_axes: dict, params: dict | None = None) -> dict:
    """The parameters' ``PartitionSpec`` tree (nested like the parameters) from flat {path: logical
    axes}; a weight of ``params`` kept quantized gets the specs of its parts."""
    values = traverse_util.flatten_dict(params) if params is not None else {}
    specs = {}
    for path, axes in param_axes.items():
        spec = plan.spec(axes)
        specs[path] = spec_of(values[path], spec) if isinstance(values.get(path), QUANTIZED_WEIGHTS) else spec
    return traverse_util.unflatten_dict(specs)


def sharded(plan: ShardingPlan, fn: Callable, in_specs, out_specs) -> Callable:
    """``fn`` run per device on the pieces ``in_specs`` name, its results put together as
    ``out_specs`` say (``P()``: the same on every device)."""
    def on_each_device(*args):
        with local_view(plan):
            return fn(*args)
    return jax.shard_map(on_each_device, mesh=plan.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


REPLICATED = P()
