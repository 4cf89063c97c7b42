"""MoE routing in one Pallas kernel (Triton lowering), same semantics as ``reference.route``.

At decode the router's jnp form is a softmax, a ``top_k`` (a sort on the GPU), a normalisation and
a few casts: four or five launches per layer for a ``[T, E]`` array that fits in registers. Here
one program takes ``block_t`` tokens' logits, scores them in float32, picks the top k by k rounds
of (row max, lowest index holding it, mask it out) -- exact, ties to the lower index as
``jax.lax.top_k`` breaks them -- and writes the weights and ids.

Grouped top-k (``n_group > 1``) is not fused: ``route`` runs the reference for it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.kernels import pdl
from jaxinfer.kernels.moe import reference

# Scores one program holds per tensor (block_t x padded experts), in one warp: its row reductions are
# then warp shuffles, with no shared-memory round trips between the k rounds (a single program of
# [32, 128] tensors over 4 warps measured far slower: docs/performance.md, "MoE routing kernel").
_REGISTER_ELEMENTS = 1024


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _kernel(logits_ref, *rest, router: str, top_k: int, norm_topk_prob: bool, norm_eps: float, scaling: float,
            block_t: int, experts_pad: int, has_bias: bool):
    if has_bias:
        bias_ref, weights_ref, ids_ref = rest
    else:
        weights_ref, ids_ref = rest
    num_tokens, num_experts = logits_ref.shape
    k_pad = ids_ref.shape[1]
    shape = (block_t, experts_pad)
    row = pl.program_id(0) * block_t + lax.broadcasted_iota(jnp.int32, shape, 0)
    col = lax.broadcasted_iota(jnp.int32, shape, 1)
    real = (row < num_tokens) & (col < num_experts)
    logits = plgpu.load(logits_ref.at[jnp.minimum(row, num_tokens - 1), jnp.minimum(col, num_experts - 1)],
                        mask=real, other=0.0).astype(jnp.float32)
    logits = jnp.where(col < num_experts, logits, -jnp.inf)

    if router == "softmax_topk":
        unnormalized = jnp.exp(logits - logits.max(axis=1, keepdims=True))
        scores = unnormalized / unnormalized.sum(axis=1, keepdims=True)
        choice = scores
    elif router == "topk_softmax":
        scores = choice = logits
    else:  # sigmoid_bias
        scores = 1.0 / (1.0 + jnp.exp(-logits))
        choice = scores
        if has_bias:
            bias = plgpu.load(bias_ref.at[jnp.minimum(col, num_experts - 1)], mask=col < num_experts, other=0.0)
            choice = scores + bias.astype(jnp.float32)
        choice = jnp.where(col < num_experts, choice, -jnp.inf)

    slot = lax.broadcasted_iota(jnp.int32, (block_t, k_pad), 1)
    ids = jnp.zeros((block_t, k_pad), jnp.int32)
    values = jnp.zeros((block_t, k_pad), jnp.float32)
    for j in range(top_k):  # k rounds: the best remaining expert, the lowest index on ties
        best = choice.max(axis=1)
        index = jnp.where(choice == best[:, None], col, experts_pad).min(axis=1)
        picked = col == index[:, None]
        value = best if router != "sigmoid_bias" else jnp.where(picked, scores, 0.0).sum(axis=1)
        ids = jnp.where(slot == j, index[:, None], ids)
        values = jnp.where(slot == j, value[:, None], values)
        choice = jnp.where(picked, -jnp.inf, choice)

    in_k = slot < top_k
    if router == "topk_softmax":
        values = jnp.where(in_k, values, -jnp.inf)
        unnormalized = jnp.exp(values - values.max(axis=1, keepdims=True))
        weights = unnormalized / unnormalized.sum(axis=1, keepdims=True)
    else:
        weights = jnp.where(in_k, values, 0.0)
        if norm_topk_prob:  # as in the reference, only the sigmoid router's normalisation adds an epsilon
            eps = norm_eps if router == "sigmoid_bias" else 0.0
            weights = weights / (weights.sum(axis=1, keepdims=True) + eps)
        if router == "sigmoid_bias":
            weights = weights * scaling
    weights_ref[...] = weights
    ids_ref[...] = ids


@functools.partial(jax.jit, static_argnames=("router", "top_k", "norm_topk_prob", "norm_eps", "routed_scaling_factor",
                                             "n_group", "topk_group", "interpret"))
def route(logits, *, router: str, top_k: int, norm_topk_prob: bool = True, norm_eps: float = 0.0,
          routed_scaling_factor: float = 1.0, n_group: int = 1, topk_group: int = 1, correction_bias=None,
          interpret: bool = False):
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32); see ``reference.route``."""
    if router not in reference.ROUTERS:
        raise ValueError(f"unknown router {router!r}; known: {reference.ROUTERS}")
    num_tokens, num_experts = logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k ({top_k}) must be in [1, num_experts={num_experts}]")
    if n_group > 1 or num_tokens == 0:
        return reference.route(logits, router=router, top_k=top_k, norm_topk_prob=norm_topk_prob, norm_eps=norm_eps,
                               routed_scaling_factor=routed_scaling_factor, n_group=n_group, topk_group=topk_group,
                               correction_bias=correction_bias)
    experts_pad = max(16, _next_pow2(num_experts))
    block_t = max(1, min(_next_pow2(num_tokens), _REGISTER_ELEMENTS // experts_pad))
    k_pad = _next_pow2(top_k)
    num_blocks = -(-num_tokens // block_t)
    has_bias = router == "sigmoid_bias" and correction_bias is not None
    inputs = [logits]
    in_specs = [pl.BlockSpec(logits.shape, lambda i: (0, 0))]
    if has_bias:
        inputs.append(correction_bias)
        in_specs.append(pl.BlockSpec(correction_bias.shape, lambda i: (0,)))
    kernel = functools.partial(_kernel, router=router, top_k=top_k, norm_topk_prob=norm_topk_prob,
                               norm_eps=float(norm_eps), scaling=float(routed_scaling_factor), block_t=block_t,
                               experts_pad=experts_pad, has_bias=has_bias)
    out_spec = pl.BlockSpec((block_t, k_pad), lambda i: (i, 0))
    weights, ids = pl.pallas_call(
        pdl.with_trigger(kernel, "moe_route", interpret=interpret),
        grid=(num_blocks,),
        in_specs=in_specs,
        out_specs=[out_spec, out_spec],
        out_shape=[jax.ShapeDtypeStruct((num_blocks * block_t, k_pad), jnp.float32),
                   jax.ShapeDtypeStruct((num_blocks * block_t, k_pad), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="moe_route",
    )(*inputs)
    if weights.shape != (num_tokens, top_k):
        weights, ids = weights[:num_tokens, :top_k], ids[:num_tokens, :top_k]
    return weights, ids


__all__ = ["route"]
