"""Mixture-of-experts ops: routing and the expert MLPs of routed tokens.

``route``, ``moe_mlp`` and ``moe_block`` dispatch by platform: the plain-jnp reference
(``reference.py``, the semantic truth; grouped matmuls through ``jax.lax.ragged_dot``) on CPU, the
Pallas kernels on GPU (``router_pallas.py``: scoring, top-k and weights in one launch, used at the
sizes where it measured faster; ``grouped_pallas.py``: the grouped GEMMs; ``block_mgpu.py``: a
one-token MoE block as one persistent kernel, where its shapes fit, else the block's ops one after
another). ``set_implementation("reference")`` forces the reference.
"""

from __future__ import annotations

from jaxinfer.kernels.dispatch import OpDispatcher
from jaxinfer.kernels import linear as linear_ops
from jaxinfer.kernels import norm as norm_ops
from jaxinfer.kernels.moe import block_mgpu, grouped_pallas, reference, router_pallas
from jaxinfer.kernels.moe.reference import ROUTERS, gated_activation


def _route_where_faster(logits, *, interpret: bool = False, **options):
    """The routing kernel where it measured faster than the jnp router on the H200
    (``scripts/moe_check.py``, ``scripts/profile_step.py``): one token (a decode step at batch 1, where
    the jnp router is four or five launches of a microsecond or more, per layer) and >= 1024 tokens
    over >= 128 experts (where XLA's sort-based top-k is slow). At 8-64 tokens the jnp router was
    faster."""
    num_tokens, num_experts = logits.shape
    if num_tokens == 1 or (num_tokens >= 1024 and num_experts >= 128):
        return router_pallas.route(logits, interpret=interpret, **options)
    return reference.route(logits, **options)


def _moe_block_where_it_fits(attn_out, residual, norm_weight, router_weight, gate, up, down, flag=None, *,
                             eps: float, top_k: int, norm_topk_prob: bool = True, interpret: bool = False):
    """The one-kernel block (``block_mgpu``) where it takes the call and flag words are given;
    otherwise the block's ops one after another (add + norm kernel, router projection, routing,
    experts) and the flag passed on unchanged (no kernel used it), which is also what interpret mode
    (CPU tests) runs: the kernel has no interpreter."""
    kernel_takes_it = block_mgpu.supports(attn_out, gate, up, down, router_weight, top_k=top_k, router="softmax_topk",
                                          norm_topk_prob=norm_topk_prob, activation="silu", has_biases=False)
    if kernel_takes_it and flag is not None and not interpret:
        stream, next_flag, _, _ = block_mgpu.moe_block(attn_out, residual, norm_weight, router_weight, gate, up,
                                                        down, flag, eps=eps)
        return stream, next_flag
    normed, h = norm_ops.add_rms_norm(attn_out, residual, norm_weight, eps)
    (logits,) = linear_ops.project(normed, [router_weight])
    weights, ids = route(logits, router="softmax_topk", top_k=top_k, norm_topk_prob=norm_topk_prob)
    return h + moe_mlp(normed, ids, weights, gate, up, down, distinct_experts=True), flag


_dispatch = OpDispatcher(
    "MoE",
    {"reference": {"moe_mlp": reference.moe_mlp, "route": reference.route, "moe_block": reference.moe_block},
     "pallas": {"moe_mlp": grouped_pallas.moe_mlp, "route": _route_where_faster,
                "moe_block": _moe_block_where_it_fits}},
    {"gpu": "pallas", "cuda": "pallas"},
)
set_implementation = _dispatch.set_implementation
implementation_name = _dispatch.implementation_name


def route(logits, **options):
    return _dispatch("route")(logits, **options)


def moe_mlp(x, expert_ids, expert_weights, gate, up, down, **options):
    return _dispatch("moe_mlp")(x, expert_ids, expert_weights, gate, up, down, **options)


def moe_block(attn_out, residual, norm_weight, router_weight, gate, up, down, flag=None, *, eps: float, top_k: int,
              norm_topk_prob: bool = True):
    """-> (the block's output ``h + MoE(RMSNorm(h))`` with ``h = attn_out + residual``, the flag words
    for the next call): a decoder layer's MoE block with softmax top-k routing; see
    ``reference.moe_block``. ``flag``: ``flag_words`` of an int32 unique to the call, or None (then
    the GPU runs the block's ops)."""
    return _dispatch("moe_block")(attn_out, residual, norm_weight, router_weight, gate, up, down, flag, eps=eps,
                                  top_k=top_k, norm_topk_prob=norm_topk_prob)


flag_words = block_mgpu.flag_words


__all__ = ["ROUTERS", "flag_words", "gated_activation", "implementation_name", "moe_block", "moe_mlp", "route",
           "set_implementation"]
