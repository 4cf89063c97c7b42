"""The mixture-of-experts block, one implementation with pluggable routers.

Routers (``softmax_topk``, ``sigmoid_bias``, ``topk_softmax``; semantics in
``jaxinfer.kernels.moe.reference.route``) run through ``jaxinfer.kernels.moe.route``; a sigmoid
router's ``e_score_correction_bias`` is a parameter of this block.

Experts are stored stacked in nn.Linear orientation (``gate``/``up`` ``[E, I, H]``, ``down``
``[E, H, I]``) and run through ``jaxinfer.kernels.moe.moe_mlp``. An optional shared expert (a plain
gated MLP, optionally scaled by ``sigmoid(shared_expert_gate(x))``) is added to every token.

A block with softmax top-k routing and nothing else (no biases, no shared expert, SiLU; ``MoESpec.
is_plain_block``) runs as one op with the residual add and RMSNorm in front of it
(``jaxinfer.kernels.moe.moe_block``), whose implementations decide how (one kernel at one token
on the GPU where it fits).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.kernels import linear as linear_ops
from jaxinfer.kernels import moe as moe_ops
from jaxinfer.kernels import norm as norm_ops
from jaxinfer.models.layers import capture
from jaxinfer.models.layers.linear import Linear, LinearParams
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
    shared_expert_name: str = "shared_expert"  # its module name in the checkpoint ("shared_experts": DeepSeek)
    router_float32: bool = False  # router weight kept and applied in float32 (DeepSeek's gate)

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; known: {ROUTERS}")

    @property
    def is_plain_block(self) -> bool:
        """Whether the block is what ``moe_ops.moe_block`` computes: softmax top-k, SiLU experts, no
        biases, no shared expert, no scaling, the router in the activations' dtype."""
        return (self.router == "softmax_topk" and not self.router_bias and not self.expert_bias
                and self.activation == "silu" and not self.shared_intermediate_size
                and self.routed_scaling_factor == 1.0 and self.norm_eps == 0.0 and not self.router_float32)


def route(logits, spec: MoESpec, correction_bias=None):
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32), as ``spec`` routes."""
    return moe_ops.route(logits, router=spec.router, top_k=spec.top_k, norm_topk_prob=spec.norm_topk_prob,
                         norm_eps=spec.norm_eps, routed_scaling_factor=spec.routed_scaling_factor,
                         n_group=spec.n_group, topk_group=spec.topk_group, correction_bias=correction_bias)


class SparseMoE(nn.Module):
    """``moe(x)`` for the normalised rows ``x``; ``moe(attn_out, block=(residual, norm_weight, eps,
    kernel_context))`` for a plain block (``MoESpec.is_plain_block``) with the residual add and RMSNorm
    in front of it: -> ``(x, residual)`` whose sum is the layer's output (``jaxinfer.kernels.moe.
    moe_block``)."""

    spec: MoESpec
    hidden_act: str = "silu"
    param_dtype: jnp.dtype = jnp.float32

    def _record_routing(self, logits, weights, ids):
        if capture.wanted(self, capture.ROUTING):
            for name, value in (("router_logits", logits), ("selected_experts", ids), ("routing_weights", weights)):
                capture.record(self, capture.ROUTING, name, value)

    @nn.compact
    def __call__(self, x, block=None):
        spec = self.spec
        if block is not None:
            residual, norm_weight, eps, kernel_context = block
            router, _ = LinearParams(spec.num_experts, False, self.param_dtype, name=spec.router_name)(x.shape[-1])
            gate, up, down = Experts(spec, x.shape[-1], self.param_dtype, name="experts").weights()
            if capture.wanted(self, capture.ROUTING):  # the block op routes inside: route again, as it does
                normed, _ = norm_ops.add_rms_norm(x, residual, norm_weight, eps)
                (logits,) = linear_ops.project(normed, [router])
                self._record_routing(logits, *route(logits, spec))
            return moe_ops.moe_block(x, residual, norm_weight, router, gate, up, down, eps=eps, top_k=spec.top_k,
                                     norm_topk_prob=spec.norm_topk_prob, context=kernel_context)
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
        out = Experts(spec, x.shape[-1], self.param_dtype, name="experts")(x, ids, weights)
        if spec.shared_intermediate_size:
            shared, _ = GatedMLP(spec.shared_intermediate_size, self.hidden_act, False, self.param_dtype,
                                 name=spec.shared_expert_name)(x)
            if spec.shared_expert_gated:
                shared = jax.nn.sigmoid(Linear(1, False, self.param_dtype, name="shared_expert_gate")(x)) * shared
            out = out + shared
        return out


class Experts(nn.Module):
    spec: MoESpec
    hidden: int
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        spec, hidden = self.spec, self.hidden
        e, i = spec.num_experts, spec.intermediate_size
        init = nn.initializers.normal(0.02)
        self.gate = self.param("gate_proj", init, (e, i, hidden), self.param_dtype)
        self.up = self.param("up_proj", init, (e, i, hidden), self.param_dtype)
        self.down = self.param("down_proj", init, (e, hidden, i), self.param_dtype)
        self.biases = {}
        if spec.expert_bias:
            zeros = nn.initializers.zeros
            self.biases = dict(gate_bias=self.param("gate_proj_bias", zeros, (e, i), self.param_dtype),
                               up_bias=self.param("up_proj_bias", zeros, (e, i), self.param_dtype),
                               down_bias=self.param("down_proj_bias", zeros, (e, hidden), self.param_dtype))

    def weights(self):
        """(gate, up, down) for ops that run the experts themselves."""
        return self.gate, self.up, self.down

    def __call__(self, x, ids, weights):
        spec = self.spec
        # Routers pick top-k: a token's k experts are distinct, which the kernel's decode path uses.
        return moe_ops.moe_mlp(x, ids, weights, self.gate, self.up, self.down, activation=spec.activation,
                               alpha=spec.alpha, limit=spec.limit, distinct_experts=True, **self.biases)
