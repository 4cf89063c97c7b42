"""The mixture-of-experts block, one implementation with pluggable routers.

Routers (``softmax_topk``, ``sigmoid_bias``, ``topk_softmax``; semantics in
``jaxinfer.kernels.moe.reference.route``) run through ``jaxinfer.kernels.moe.route``; a sigmoid
router's ``e_score_correction_bias`` is a parameter of this block.

Experts are stored stacked in nn.Linear orientation (``gate``/``up`` ``[E, I, H]``, ``down``
``[E, H, I]``; or kept quantized, ``jaxinfer.quantization``) and run through
``jaxinfer.kernels.moe.moe_mlp``, quantized ones as stored. An optional shared expert (a plain gated
MLP, optionally scaled by ``sigmoid(shared_expert_gate(x))``) is added to every token.

**Partitioning** (``jaxinfer.sharding.plan``). The router and its correction bias are replicated: the
activations are the same on every device, so every device routes every token the same way.

* Tensor parallel: each expert's width is split (``EXPERT_MLP``): a device runs every expert on its
  slice of ``I`` (the gated activation is elementwise over ``I``), giving a partial output that the
  sum over the devices completes; the down projection's bias is added once, after that sum.
* Expert parallel: the experts are split whole (``EXPERTS``) over all ``N`` devices: device ``d``
  holds experts ``[d * E / N, (d + 1) * E / N)``. Within a data-parallel rank the tokens are on
  every device; across ranks they are gathered first (each device then sees every rank's tokens).
  The dispatch is then local: routed ids become local ids, and ids of other devices' experts become
  -1, which the expert op drops (no rows, no blocks, a zero in its sum). Summing over the tensor
  devices and reduce-scattering over the ranks (each rank keeps its own tokens' rows) combines
  each token's experts: the all-gather + reduce-scatter scheme. Per device it moves ``2 (D - 1)``
  times one rank's activations, against ``2 k (D - 1) / D`` for an all-to-all that sends each token
  to the ranks of its ``k`` experts (``docs/sharding.md``): less while ``D < k`` (DeepSeek-V3, k = 8:
  up to 8 ranks), with no capacity to pad and no ragged shapes.

The shared expert's down projection is row-parallel over the same devices: its partial output (scaled
by its gate, a per-token scalar of the replicated input) is added to the routed partial and the
block's output is reduced once.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.kernels import moe as moe_ops
from jaxinfer.models.layers import capture
from jaxinfer.models.layers.linear import Linear
from jaxinfer.models.layers.mlp import GatedMLP
from jaxinfer.models.layers.norm import Rows
from jaxinfer.quantization import Mxfp4Weight
from jaxinfer.sharding import local
from jaxinfer.sharding.plan import BATCH, EXPERT_MLP, EXPERTS, MLP

ROUTERS = moe_ops.ROUTERS


@dataclasses.dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int
    router: str = "softmax_topk"
    norm_topk_prob: bool = True
    norm_eps: float = 0.0
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    router_name: str = "gate"  # the router's module name in the checkpoint
    router_bias: bool = False  # a bias on the router projection (GPT-OSS)
    expert_bias: bool = False  # biases on the expert projections (GPT-OSS)
    activation: str = "silu"  # see jaxinfer.kernels.moe.reference
    alpha: float = 1.702
    limit: float = 7.0
    shared_intermediate_size: int | None = None
    shared_expert_gated: bool = False
    shared_expert_name: str = "shared_expert"  # its module name in the checkpoint ("shared_experts": DeepSeek)
    router_float32: bool = False  # router weight kept and applied in float32 (DeepSeek's gate)

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; known: {ROUTERS}")


def route(logits, spec: MoESpec, correction_bias=None):
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32), as ``spec`` routes."""
    return moe_ops.route(logits, router=spec.router, top_k=spec.top_k, norm_topk_prob=spec.norm_topk_prob,
                         norm_eps=spec.norm_eps, routed_scaling_factor=spec.routed_scaling_factor,
                         n_group=spec.n_group, topk_group=spec.topk_group, correction_bias=correction_bias)


def _sum(x, axes: tuple[str, ...]):
    return jax.lax.psum(x, axes) if axes else x


def _routed_axis() -> str:
    """The logical axis the routed experts' partial outputs are summed over: the experts themselves
    under expert parallelism, else their width."""
    return EXPERTS if local.ways(EXPERTS) > 1 else EXPERT_MLP


class SparseMoE(nn.Module):
    """``moe(x)`` for the normalised rows ``x`` (the same on every device) -> the block's output,
    whole on every device."""

    spec: MoESpec
    hidden_act: str = "silu"
    param_dtype: jnp.dtype = jnp.float32

    def _record_routing(self, logits, weights, ids):
        if capture.wanted(self, capture.ROUTING):
            for name, value in (("router_logits", logits), ("selected_experts", ids), ("routing_weights", weights)):
                capture.record(self, capture.ROUTING, name, value)

    def _route(self, x):
        """The replicated router: -> (weights [T, k] float32, global expert ids [T, k])."""
        spec = self.spec
        if spec.router_float32:
            logits = Linear(spec.num_experts, spec.router_bias, jnp.float32, name=spec.router_name)(x.astype(jnp.float32))
        else:
            logits = Linear(spec.num_experts, spec.router_bias, self.param_dtype, name=spec.router_name)(x)
        correction = None
        if spec.router == "sigmoid_bias":
            correction = self.param("e_score_correction_bias", nn.initializers.zeros, (spec.num_experts,), jnp.float32)
        # float32 weights: the expert op rounds them to x's dtype, as HF casts them (rounding there
        # spares a separate cast kernel between the router and the experts).
        weights, ids = route(logits, spec, correction)
        self._record_routing(logits, weights, ids)
        return weights, ids

    def _shared_partial(self, x):
        """The shared expert's output before its sum over the devices, scaled by its gate."""
        spec = self.spec
        shared = GatedMLP(spec.shared_intermediate_size, self.hidden_act, False, self.param_dtype, reduce=False,
                          name=spec.shared_expert_name)(Rows(x))
        if spec.shared_expert_gated:
            shared = jax.nn.sigmoid(Linear(1, False, self.param_dtype, name="shared_expert_gate")(x)) * shared
        return shared

    @nn.compact
    def __call__(self, x):
        spec = self.spec
        weights, ids = self._route(x)
        experts = Experts(spec, x.shape[-1], self.param_dtype, name="experts")
        summed_over = local.mesh_axes(_routed_axis())
        # Data-parallel ranks whose experts differ: every rank's tokens reach every device.
        ranks = tuple(a for a in local.mesh_axes(BATCH) if a in summed_over)
        if ranks:
            gather = lambda a: jax.lax.all_gather(a, ranks, axis=0, tiled=True)  # noqa: E731
            out = experts(gather(x), gather(ids), gather(weights))
            out = jax.lax.psum_scatter(out, ranks, scatter_dimension=0, tiled=True)  # each rank's own rows
            summed_over = tuple(a for a in summed_over if a not in ranks)
        else:
            out = experts(x, ids, weights)
        if spec.shared_intermediate_size:
            shared = self._shared_partial(x)
            if summed_over == local.mesh_axes(MLP):  # one sum for the sublayer
                out = out + shared
            else:
                out, summed_over = _sum(out, summed_over) + local.sum_over(shared, MLP), ()
        return experts.add_down_bias(_sum(out, summed_over), ids, weights)


class Experts(nn.Module):
    """The stacked routed experts, as this device holds them: every expert's slice of the width
    (tensor parallel) or its whole experts (expert parallel). ``__call__`` gives this device's partial
    output; the caller sums it over the devices and then calls ``add_down_bias``."""

    spec: MoESpec
    hidden: int
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        spec, hidden = self.spec, self.hidden
        e, i = spec.num_experts, spec.intermediate_size
        init = nn.initializers.normal(0.02)
        param = lambda name, init, shape, axes: local.param(self, name, init, shape, axes, self.param_dtype)  # noqa: E731
        self.gate = self._projection("gate_proj", init, (e, i, hidden), (EXPERTS, EXPERT_MLP, None))
        self.up = self._projection("up_proj", init, (e, i, hidden), (EXPERTS, EXPERT_MLP, None))
        self.down = self._projection("down_proj", init, (e, hidden, i), (EXPERTS, None, EXPERT_MLP))
        self.biases = {}
        if spec.expert_bias:
            zeros = nn.initializers.zeros
            self.biases = dict(gate_bias=param("gate_proj_bias", zeros, (e, i), (EXPERTS, EXPERT_MLP)),
                               up_bias=param("up_proj_bias", zeros, (e, i), (EXPERTS, EXPERT_MLP)),
                               down_bias=param("down_proj_bias", zeros, (e, hidden), (EXPERTS, None)))

    def _projection(self, name: str, init, shape: tuple[int, ...], axes: tuple):
        """A stacked projection: a plain or fp8 parameter, or one loaded in MXFP4, taken as it is (its
        packed parts have no ``[E, out, in]`` part for flax's shape check), checked against this
        device's shape."""
        if self.has_variable("params", name):
            stored = self.get_variable("params", name)
            if isinstance(stored, Mxfp4Weight):
                want = tuple(local.local(size, logical) for size, logical in zip(shape, axes))
                if stored.shape != want:
                    raise ValueError(f"{name}: MXFP4 weight of shape {stored.shape}, expected {want}")
                return stored
        return local.param(self, name, init, shape, axes, self.param_dtype)

    def _down_bias_after_sum(self) -> bool:
        """Whether the down bias waits for the sum over the devices: with the width split, every device
        computes part of every expert's row, so the bias may be added only once, after."""
        return "down_bias" in self.biases and local.ways(EXPERT_MLP) > 1

    def _local_ids(self, ids):
        """Routed ids as this device's expert indices; -1 (dropped) for experts other devices hold."""
        held = self.gate.shape[0]
        if held == self.spec.num_experts:
            return ids
        mine = ids - local.index(EXPERTS) * held
        return jnp.where((mine >= 0) & (mine < held), mine, -1)

    def __call__(self, x, ids, weights):
        spec = self.spec
        biases = dict(self.biases)
        if self._down_bias_after_sum():
            del biases["down_bias"]
        # Routers pick top-k: a token's k experts are distinct, which the kernel's decode path uses.
        # Quantized experts (fp8, MXFP4) go to the op as stored: its kernels read them as they are.
        return moe_ops.moe_mlp(x, self._local_ids(ids), weights, self.gate, self.up, self.down,
                               activation=spec.activation, alpha=spec.alpha, limit=spec.limit,
                               distinct_experts=True, **biases)

    def add_down_bias(self, out, ids, weights):
        """``out`` (summed over the devices) plus each token's weighted down biases where they were
        left out of the partial outputs; the weights rounded to ``out``'s dtype, as the op rounds them."""
        if not self._down_bias_after_sum():
            return out
        bias = self.biases["down_bias"].astype(out.dtype)[ids]  # [T, k, H]
        scale = weights.astype(out.dtype)[..., None]
        return out + (bias * scale).sum(axis=1)
