"""Mixture-of-experts ops: routing, the expert MLPs of routed tokens, and a pre-norm MoE block.

Implementations (chosen by ``jaxinfer.kernels.registry``): the plain-jnp references
(``reference.py``, the semantic truth; grouped matmuls through ``jax.lax.ragged_dot``); the Pallas
kernels ``router_pallas.py`` (scoring, top-k and weights in one launch, preferred at the sizes where
it measured faster) and ``grouped_pallas.py`` (the grouped GEMMs); and ``block_mgpu.py``, one
token's whole MoE block as one persistent Mosaic GPU kernel where its shapes and the device fit,
else the block's ops one after another (``"ops"``).
"""

from __future__ import annotations

from jaxinfer.kernels import linear as linear_ops
from jaxinfer.kernels import norm as norm_ops
from jaxinfer.kernels.moe import block_mgpu, grouped_pallas, reference, router_pallas
from jaxinfer.kernels.moe.reference import ROUTERS, gated_activation
from jaxinfer.kernels.registry import Implementation, Op, Target, where_pallas_runs

# Where the routing kernel measured faster than the jnp router on the H200 (docs/performance.md,
# "MoE routing"): one token (a batch-1 decode step, where the jnp router is four or five launches of
# a microsecond or more), and many tokens over many experts (XLA's sort-based top-k is slow there).
# At 8-64 tokens the jnp router was faster.
ROUTER_KERNEL_PREFERRED = {"one_token": 1, "min_tokens": 1024, "min_experts": 128}


def _router_preferred(target: Target, logits, **options) -> bool:
    num_tokens, num_experts = logits.shape
    t = ROUTER_KERNEL_PREFERRED
    return num_tokens == t["one_token"] or (num_tokens >= t["min_tokens"] and num_experts >= t["min_experts"])


def _block_kernel_supports(target: Target, attn_out, residual, norm_weight, router_weight, gate, up, down, *,
                           eps: float, top_k: int, norm_topk_prob: bool = True, context=None) -> bool:
    return (context is not None and block_mgpu.device_fits(target)
            and block_mgpu.fits(attn_out, gate, up, down, router_weight, top_k=top_k, router="softmax_topk",
                                norm_topk_prob=norm_topk_prob, activation="silu", has_biases=False)
            and residual is not None and residual.shape == attn_out.shape and norm_weight.shape == (block_mgpu.HIDDEN,))


def _block_kernel(attn_out, residual, norm_weight, router_weight, gate, up, down, *, eps: float, top_k: int,
                  norm_topk_prob: bool = True, context=None):
    """The one-kernel block: its flag from the call's kernel context, the next layer's flag and the
    kernel's fault status handed back to it."""
    flag = context.flag("moe.moe_block", block_mgpu.flag_words)
    out = block_mgpu.moe_block(attn_out, residual, norm_weight, router_weight, gate, up, down, flag, eps=eps)
    context.chain_flag("moe.moe_block", out.next_flag)
    context.report_fault("moe.moe_block", block_mgpu.timed_out(out, flag))
    return out.stream, None


def _block_ops(attn_out, residual, norm_weight, router_weight, gate, up, down, *, eps: float, top_k: int,
               norm_topk_prob: bool = True, context=None):
    """The block's ops one after another, each chosen by the registry: add + norm, the router
    projection, routing, experts."""
    normed, h = norm_ops.add_rms_norm(attn_out, residual, norm_weight, eps)
    (logits,) = linear_ops.project(normed, [router_weight])
    weights, ids = route(logits, router="softmax_topk", top_k=top_k, norm_topk_prob=norm_topk_prob)
    return moe_mlp(normed, ids, weights, gate, up, down, distinct_experts=True), h


route_op = Op("moe.route", reference.route, (
    Implementation("router", router_pallas.route, preferred=_router_preferred),
))
moe_mlp_op = Op("moe.moe_mlp", reference.moe_mlp, (Implementation("grouped", grouped_pallas.moe_mlp),))
moe_block_op = Op("moe.moe_block", reference.moe_block, (
    Implementation("block_mgpu", _block_kernel, _block_kernel_supports, pallas=False),
    Implementation("ops", _block_ops, where_pallas_runs(), pallas=False),
))


def route(logits, **options):
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32); see the reference."""
    return route_op(logits, **options)


def moe_mlp(x, expert_ids, expert_weights, gate, up, down, **options):
    """x [T, H] -> [T, H]: each token's experts' MLPs weighted and summed; see the reference."""
    return moe_mlp_op(x, expert_ids, expert_weights, gate, up, down, **options)


def moe_block(attn_out, residual, norm_weight, router_weight, gate, up, down, *, eps: float, top_k: int,
              norm_topk_prob: bool = True, context=None):
    """A pre-norm layer's MoE block with softmax top-k routing, no biases, no shared expert
    (``reference.moe_block``) -> ``(x, residual)`` whose sum is the layer's output (``residual`` may
    be None: ``x`` is then the whole stream). ``context``: the model call's ``KernelContext``, which
    the one-token kernel needs (without it the block runs as ops)."""
    return moe_block_op(attn_out, residual, norm_weight, router_weight, gate, up, down, eps=eps, top_k=top_k,
                        norm_topk_prob=norm_topk_prob, context=context)


__all__ = ["ROUTERS", "gated_activation", "moe_block", "moe_mlp", "route"]
