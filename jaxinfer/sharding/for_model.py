"""The plan of one model: the mesh it asks for (or is given), factored for its KV heads, and the
rule table resolved against the sizes its layers declare."""

from __future__ import annotations

from jax.sharding import AbstractMesh, Mesh

from jaxinfer.cache.specs import PagedKV
from jaxinfer.config import ModelConfig
from jaxinfer.errors import ConfigError
from jaxinfer.sharding.plan import DATA, MESH_AXES, ShardingPlan, as_plan_mesh, kv_replicas, make_mesh, resolve


def kv_head_count(model_cls, config: ModelConfig) -> int | None:
    """The KV heads of the model's GQA layers (None without any); one count for all of them."""
    counts = {spec.num_kv_heads for specs in model_cls.cache_specs(config) for spec in specs
              if isinstance(spec, PagedKV)}
    if len(counts) > 1:
        raise ConfigError(f"layers with different KV head counts {sorted(counts)} cannot share one tensor-parallel "
                          "layout yet")
    return counts.pop() if counts else None


def plan_for(model_cls, config: ModelConfig, param_shapes: dict, param_axes: dict, *, mesh: Mesh | None = None,
             tensor_parallel_size: int = 1, data_parallel_size: int = 1,
             enable_expert_parallel: bool = False) -> ShardingPlan:
    """The ``ShardingPlan`` of a model whose parameters have ``param_shapes`` and ``param_axes``
    ({path: ...}, from ``jaxinfer.weights.declared_params``), on ``mesh`` or on a new mesh of
    ``tensor_parallel_size`` x ``data_parallel_size`` devices. ``ConfigError`` before anything is
    allocated when the counts cannot work."""
    for name, value in (("tensor_parallel_size", tensor_parallel_size), ("data_parallel_size", data_parallel_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if mesh is not None and (tensor_parallel_size, data_parallel_size) != (1, 1):
        raise ConfigError("give either a mesh or tensor_parallel_size / data_parallel_size, not both")
    if mesh is not None:
        names = tuple(mesh.axis_names)
        data_parallel_size = mesh.shape[DATA] if DATA in names else 1
        tensor_parallel_size = mesh.devices.size // data_parallel_size
    replicas = kv_replicas(tensor_parallel_size, kv_head_count(model_cls, config))
    mesh = (as_plan_mesh(mesh, replicas) if mesh is not None
            else make_mesh(tensor_parallel_size, data_parallel_size, kv_replicas=replicas))
    return resolve(mesh, param_axes, param_shapes, expert_parallel=enable_expert_parallel)


def abstract_plan(model_cls, config: ModelConfig, param_shapes: dict, param_axes: dict, *,
                  tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                  enable_expert_parallel: bool = False) -> ShardingPlan:
    """The plan the model would have on ``tensor_parallel_size`` x ``data_parallel_size`` devices,
    over an abstract mesh: for sizes per device (``jaxinfer info``), on a machine of any size."""
    replicas = kv_replicas(tensor_parallel_size, kv_head_count(model_cls, config))
    mesh = AbstractMesh((data_parallel_size, tensor_parallel_size // replicas, replicas), MESH_AXES)
    return resolve(mesh, param_axes, param_shapes, expert_parallel=enable_expert_parallel)
