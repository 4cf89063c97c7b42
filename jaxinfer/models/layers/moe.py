"""The mixture-of-experts block, one implementation with pluggable routers.

Routers (``softmax_topk``, ``sigmoid_bias``, ``topk_softmax``; semantics in
``jaxinfer.kernels.moe.reference.route``) run through ``jaxinfer.kernels.moe.route``; a sigmoid
router's ``e_score_correction_bias`` is a parameter of this block.

Experts are stored stacked in nn.Linear orientation (``gate``/``up`` ``[E, I, H]``, ``down``
``[E, H, I]``) and run through ``jaxinfer.kernels.moe.moe_mlp``. An optional shared expert (a plain
gated MLP, optionally scaled by ``sigmoid(shared_expert_gate(x))``) is added to every token.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.kernels import moe as moe_ops
from jaxinfer.models.layers.linear import Linear
from jaxinfer.models.layers.mlp import GatedMLP

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

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; known: {ROUTERS}")


def route(logits, spec: MoESpec, correction_bias=None):
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32), as ``spec`` routes."""
    return moe_ops.route(logits, router=spec.router, top_k=spec.top_k, norm_topk_prob=spec.norm_topk_prob,
                         norm_eps=spec.norm_eps, routed_scaling_factor=spec.routed_scaling_factor,
                         n_group=spec.n_group, topk_group=spec.topk_group, correction_bias=correction_bias)


class SparseMoE(nn.Module):
    spec: MoESpec
    hidden_act: str = "silu"
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        spec = self.spec
        logits = Linear(spec.num_experts, spec.router_bias, self.param_dtype, name=spec.router_name)(x)
        correction = None
        if spec.router == "sigmoid_bias":
            correction = self.param("e_score_correction_bias", nn.initializers.zeros, (spec.num_experts,), jnp.float32)
        # float32 weights: the expert op rounds them to x's dtype, as HF casts them (rounding there
        # spares a separate cast kernel between the router and the experts).
        weights, ids = route(logits, spec, correction)
        out = Experts(spec, self.param_dtype, name="experts")(x, ids, weights)
        if spec.shared_intermediate_size:
            shared, _ = GatedMLP(spec.shared_intermediate_size, self.hidden_act, False, self.param_dtype,
                                 name="shared_expert")(x)
            if spec.shared_expert_gated:
                shared = jax.nn.sigmoid(Linear(1, False, self.param_dtype, name="shared_expert_gate")(x)) * shared
            out = out + shared
        return out


class Experts(nn.Module):
    spec: MoESpec
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, ids, weights):
        spec, hidden = self.spec, x.shape[-1]
        e, i = spec.num_experts, spec.intermediate_size
        init = nn.initializers.normal(0.02)
        gate = self.param("gate_proj", init, (e, i, hidden), self.param_dtype)
        up = self.param("up_proj", init, (e, i, hidden), self.param_dtype)
        down = self.param("down_proj", init, (e, hidden, i), self.param_dtype)
        biases = {}
        if spec.expert_bias:
            zeros = nn.initializers.zeros
            biases = dict(gate_bias=self.param("gate_proj_bias", zeros, (e, i), self.param_dtype),
                          up_bias=self.param("up_proj_bias", zeros, (e, i), self.param_dtype),
                          down_bias=self.param("down_proj_bias", zeros, (e, hidden), self.param_dtype))
        # Routers pick top-k: a token's k experts are distinct, which the kernel's decode path uses.
        return moe_ops.moe_mlp(x, ids, weights, gate, up, down, activation=spec.activation, alpha=spec.alpha,
                               limit=spec.limit, distinct_experts=True, **biases)
