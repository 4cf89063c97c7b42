"""The mixture-of-experts block, one implementation with pluggable routers.

Routers (all score in float32):

* ``softmax_topk`` (Qwen3-MoE, Mixtral, Qwen3-Next): softmax over all experts, top-k, renormalised
  when ``norm_topk_prob``.
* ``sigmoid_bias`` (DeepSeek-V3, MiniMax-M2, Kimi): sigmoid scores; experts are *chosen* by score +
  ``e_score_correction_bias`` (optionally within the best ``topk_group`` of ``n_group`` groups, a
  group scored by the sum of its top-2), *weighted* by the unbiased score, normalised when
  ``norm_topk_prob`` (``/ (sum + norm_eps)``), then scaled by ``routed_scaling_factor``.
* ``topk_softmax`` (GPT-OSS): top-k of the (biased) router logits, softmax over those k.

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

ROUTERS = ("softmax_topk", "sigmoid_bias", "topk_softmax")


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
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32)."""
    logits = logits.astype(jnp.float32)
    if spec.router == "softmax_topk":
        weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), spec.top_k)
        if spec.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return weights, ids
    if spec.router == "topk_softmax":
        values, ids = jax.lax.top_k(logits, spec.top_k)
        return jax.nn.softmax(values, axis=-1), ids
    scores = jax.nn.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)
    if spec.n_group > 1:
        t, e = choice.shape
        grouped = choice.reshape(t, spec.n_group, e // spec.n_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)
        kept = jax.lax.top_k(group_scores, spec.topk_group)[1]
        keep = jnp.zeros((t, spec.n_group), bool).at[jnp.arange(t)[:, None], kept].set(True)
        choice = jnp.where(jnp.repeat(keep, e // spec.n_group, axis=1), choice, 0.0)
    ids = jax.lax.top_k(choice, spec.top_k)[1]
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + spec.norm_eps)
    return weights * spec.routed_scaling_factor, ids


class SparseMoE(nn.Module):
    spec: MoESpec
    hidden_act: str = "silu"
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        spec, hidden = self.spec, x.shape[-1]
        logits = Linear(spec.num_experts, spec.router_bias, self.param_dtype, name=spec.router_name)(x)
        correction = None
        if spec.router == "sigmoid_bias":
            correction = self.param("e_score_correction_bias", nn.initializers.zeros, (spec.num_experts,), jnp.float32)
        weights, ids = route(logits, spec, correction)
        weights = weights.astype(x.dtype)  # HF casts the routing weights to the activation dtype
        out = Experts(spec, self.param_dtype, name="experts")(x, ids, weights)
        if spec.shared_intermediate_size:
            shared = GatedMLP(spec.shared_intermediate_size, self.hidden_act, False, self.param_dtype,
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
