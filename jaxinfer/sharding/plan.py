"""How one model is partitioned: the logical axes layers declare, the one rule table that maps them to
mesh axes, and the mesh a model runs on.

Layers never name mesh axes. A parameter or cache array declares what each of its dimensions *is*
(``HEADS``, ``KV_HEADS``, ``MLP``, ``EXPERTS``, ``VOCAB``, ...; ``None`` for a dimension every device
holds whole), and ``RULES`` says where each logical axis goes:

* tensor parallelism (``T`` devices) splits attention and linear-attention heads, MLP width and the
  vocabulary ``T`` ways; row-parallel outputs (o_proj, down_proj) are summed once per sublayer;
* KV heads split over as many devices as there are KV heads at most: with fewer KV heads than ``T``,
  each KV head (its k/v projection rows and its cache) is held by the ``T / kv_heads`` devices whose
  query heads read it, as vLLM does. The tensor axis is then factored as ``(model, kv_replica)``;
  splits over the whole tensor axis use both;
* expert parallelism moves the split from each expert's width (``EXPERT_MLP``) to the experts
  themselves (``EXPERTS``), over every device (data-parallel ranks included, as vLLM does);
* data parallelism (``D`` ranks of ``T`` devices) splits the step's rows (``BATCH``: its tokens and
  sequences) and the cache pool (``PAGES``, ``SLOTS``): each rank serves its own sequences from its
  own pages and state slots, with the weights replicated over the ranks (experts excepted);
* everything else (the hidden size, MLA's latent, norms, routers) is replicated.

A ``ShardingPlan`` is that table resolved for one config and mesh: it knows which logical axes are
split how many ways. Counts that cannot be split are a ``ConfigError`` before anything is loaded.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxinfer.errors import ConfigError

logger = logging.getLogger(__name__)

# Mesh axes.
DATA = "data"
TENSOR = "model"
KV_REPLICA = "kv_replica"
MESH_AXES = (DATA, TENSOR, KV_REPLICA)

# Logical axes.
VOCAB = "vocab"  # the embedding's and LM head's rows
HEADS = "heads"  # attention query heads; linear-attention key and value heads; their channels
KV_HEADS = "kv_heads"  # GQA key/value heads
MLP = "mlp"  # a dense MLP's (or shared expert's) intermediate width
EXPERTS = "experts"  # routed experts
EXPERT_MLP = "expert_mlp"  # a routed expert's intermediate width
BATCH = "batch"  # a step's token and sequence rows (its inputs, logits and samples)
PAGES = "pages"  # the cache's pages
SLOTS = "slots"  # the cache's per-sequence state slots
LOGICAL_AXES = (VOCAB, HEADS, KV_HEADS, MLP, EXPERTS, EXPERT_MLP, BATCH, PAGES, SLOTS)

WHOLE_TENSOR = (TENSOR, KV_REPLICA)


def rules(expert_parallel: bool) -> dict[str, tuple[str, ...]]:
    """The rule table: logical axis -> the mesh axes it is split over (absent: replicated)."""
    table = {VOCAB: WHOLE_TENSOR, HEADS: WHOLE_TENSOR, KV_HEADS: (TENSOR,), MLP: WHOLE_TENSOR,
             BATCH: (DATA,), PAGES: (DATA,), SLOTS: (DATA,)}
    if expert_parallel:
        table[EXPERTS] = (DATA, *WHOLE_TENSOR)
    else:
        table[EXPERT_MLP] = WHOLE_TENSOR
    return table


def kv_replicas(tensor_parallel: int, num_kv_heads: int | None) -> int:
    """How many devices hold each KV head: 1 where the KV heads split ``tensor_parallel`` ways, else
    ``tensor_parallel / num_kv_heads``; ``ConfigError`` where neither divides the other."""
    if not num_kv_heads or num_kv_heads % tensor_parallel == 0:
        return 1
    if tensor_parallel % num_kv_heads == 0:
        return tensor_parallel // num_kv_heads
    raise ConfigError(f"num_key_value_heads ({num_kv_heads}) and tensor_parallel_size ({tensor_parallel}) must "
                      "divide one into the other: KV heads are split over the tensor-parallel devices, or each held "
                      "by tensor_parallel_size / num_key_value_heads of them")


def make_mesh(tensor_parallel: int = 1, data_parallel: int = 1, devices=None, *, kv_replicas: int = 1) -> Mesh:
    """A ``(data, model, kv_replica)`` mesh over the first ``data_parallel * tensor_parallel`` devices;
    the tensor axis is ``model x kv_replica`` (see the module docstring)."""
    devices = list(devices if devices is not None else jax.devices())
    need = tensor_parallel * data_parallel
    if need > len(devices):
        raise ConfigError(f"tensor_parallel_size x data_parallel_size = {tensor_parallel} x {data_parallel} needs "
                          f"{need} devices; {len(devices)} are available")
    if tensor_parallel % kv_replicas:
        raise ConfigError(f"kv_replicas ({kv_replicas}) must divide tensor_parallel_size ({tensor_parallel})")
    grid = np.array(devices[:need]).reshape(data_parallel, tensor_parallel // kv_replicas, kv_replicas)
    return Mesh(grid, MESH_AXES)


def as_plan_mesh(mesh: Mesh, replicas: int) -> Mesh:
    """``mesh`` (axes ``(data, model)``, or already a plan's) with its tensor axis factored for
    ``replicas`` devices per KV head."""
    if tuple(mesh.axis_names) == MESH_AXES and mesh.shape[KV_REPLICA] == replicas:
        return mesh
    names = tuple(mesh.axis_names)
    if names == MESH_AXES:
        data, tensor = mesh.shape[DATA], mesh.shape[TENSOR] * mesh.shape[KV_REPLICA]
    elif names == (DATA, TENSOR):
        data, tensor = mesh.shape[DATA], mesh.shape[TENSOR]
    else:
        raise ConfigError(f"a mesh's axes must be {(DATA, TENSOR)} (make one with jaxinfer.sharding.make_mesh); "
                          f"got {names}")
    return make_mesh(tensor, data, list(mesh.devices.flat), kv_replicas=replicas)


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """The rule table resolved for one model on one mesh (axes ``MESH_AXES``)."""

    mesh: Mesh
    expert_parallel: bool = False
    replicated: frozenset[str] = frozenset()  # logical axes the rules split that this model keeps whole

    @property
    def tensor_parallel(self) -> int:
        return self.mesh.shape[TENSOR] * self.mesh.shape[KV_REPLICA]

    @property
    def data_parallel(self) -> int:
        return self.mesh.shape[DATA]

    @property
    def size(self) -> int:
        return math.prod(self.mesh.shape.values())

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        """The mesh axes ``logical`` is split over (``()``: replicated), size-1 axes left out."""
        if logical is None or logical in self.replicated:
            return ()
        return tuple(a for a in rules(self.expert_parallel).get(logical, ()) if self.mesh.shape[a] > 1)

    def ways(self, logical: str | None) -> int:
        """How many pieces ``logical`` is split into."""
        return math.prod(self.mesh.shape[a] for a in self.mesh_axes(logical))

    def spec(self, logical_axes) -> P:
        """The ``PartitionSpec`` of an array whose dimensions are ``logical_axes``."""
        parts = []
        for logical in logical_axes:
            axes = self.mesh_axes(logical)
            parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*parts)

    def sharding(self, logical_axes) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical_axes))

    def replicated_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def describe(self) -> dict:
        """The plan as data (for ``jaxinfer info`` and export manifests)."""
        return {"tensor_parallel_size": self.tensor_parallel, "data_parallel_size": self.data_parallel,
                "kv_replicas": self.mesh.shape[KV_REPLICA], "expert_parallel": self.expert_parallel,
                "replicated": sorted(self.replicated)}


def bytes_per_device(shape, dtype, logical_axes, plan: ShardingPlan) -> int:
    """Bytes of one device's piece of an array of ``shape`` whose dimensions are ``logical_axes``."""
    return math.prod(size // plan.ways(logical) for size, logical in zip(shape, logical_axes)) * np.dtype(dtype).itemsize


# What each logical axis usually is in a config, for error messages.
FIELDS = {VOCAB: "vocab_size", HEADS: "num_attention_heads (or the linear-attention head counts)",
          KV_HEADS: "num_key_value_heads", MLP: "intermediate_size", EXPERTS: "the routed expert count",
          EXPERT_MLP: "moe_intermediate_size", BATCH: "the step's rows", PAGES: "num_pages",
          SLOTS: "max_num_seqs"}


def resolve(mesh: Mesh, param_axes: dict, param_shapes: dict, *, expert_parallel: bool = False) -> ShardingPlan:
    """The plan of a model whose parameters have ``param_axes`` ({path: logical axes}) and
    ``param_shapes`` ({path: ShapeDtypeStruct}) on ``mesh``: a vocabulary that does not split evenly stays
    replicated (logged); any other split dimension that does not divide is a ``ConfigError``
    naming the parameter, the axis and the config field."""
    plan = ShardingPlan(mesh, expert_parallel)
    uneven: dict[str, list[str]] = {}
    for path, axes in param_axes.items():
        for dim, logical in enumerate(axes):
            ways = plan.ways(logical)
            size = param_shapes[path].shape[dim]
            if ways > 1 and size % ways:
                uneven.setdefault(logical, []).append(f"{'.'.join(path)} dim {dim} ({size})")
    if VOCAB in uneven:
        logger.warning("the vocabulary does not split over %d devices: the embedding and LM head stay replicated",
                       plan.ways(VOCAB))
        plan = dataclasses.replace(plan, replicated=frozenset({VOCAB}))
        del uneven[VOCAB]
    if uneven:
        parts = [f"{logical} ({FIELDS[logical]}) does not split {plan.ways(logical)} ways: "
                 + ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                 for logical, names in uneven.items()]
        hint = "" if expert_parallel or EXPERT_MLP not in uneven else (
            "; with --enable-expert-parallel the experts are split whole instead of their width")
        sizes = f"tensor_parallel_size = {plan.tensor_parallel}"
        if plan.data_parallel > 1:
            sizes += f", data_parallel_size = {plan.data_parallel}"
        raise ConfigError(f"the model cannot be split over {sizes}: " + "; ".join(parts)
                          + f"; choose sizes that divide them{hint}")
    return plan
