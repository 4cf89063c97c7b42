"""Mixture-of-experts ops: routing and the expert MLPs of routed tokens.

Implementations (chosen by ``jaxinfer.kernels.registry``): the plain-jnp references
(``reference.py``, the semantic truth; grouped matmuls through ``jax.lax.ragged_dot``) and the Pallas
kernels ``router_pallas.py`` (scoring, top-k and weights in one launch, preferred at the sizes where
it measured faster) and ``grouped_pallas.py`` (the grouped GEMMs; experts plain, fp8 or MXFP4, read
as stored through ``expert_tiles.py``). Every op works on the shapes it is given, so under tensor or
expert parallelism it runs on each device's experts (or expert widths); expert ids outside ``[0, E)``
are dropped (``reference.py``).
"""

from __future__ import annotations

from jaxinfer.kernels.moe import grouped_pallas, reference, router_pallas
from jaxinfer.kernels.moe.reference import ROUTERS, gated_activation
from jaxinfer.kernels.registry import Implementation, Op, Target
from jaxinfer.quantization import Fp8Weight

# Where the routing kernel measured faster than the jnp router on the H200 (docs/performance.md,
# "MoE routing"): one token (a batch-1 decode step, where the jnp router is four or five launches of
# a microsecond or more), and many tokens over many experts (XLA's sort-based top-k is slow there).
# At 8-64 tokens the jnp router was faster.
ROUTER_KERNEL_PREFERRED = {"one_token": 1, "min_tokens": 1024, "min_experts": 128}


def _router_preferred(target: Target, logits, **options) -> bool:
    num_tokens, num_experts = logits.shape
    t = ROUTER_KERNEL_PREFERRED
    return num_tokens == t["one_token"] or (num_tokens >= t["min_tokens"] and num_experts >= t["min_experts"])


route_op = Op("moe.route", reference.route, (
    Implementation("router", router_pallas.route, preferred=_router_preferred),
))


def _grouped_supports(target: Target, x, expert_ids, expert_weights, gate, up, down, **options) -> bool:
    """The grouped kernels take plain, fp8 and MXFP4 experts (``grouped_pallas.unsupported``); fp8
    ones only where Pallas reads e4m3 (``Target.reads_float8``)."""
    if not target.runs_pallas or grouped_pallas.unsupported(gate, up, down, **options):
        return False
    return target.reads_float8 or not any(isinstance(w, Fp8Weight) for w in (gate, up, down))


# The grouped kernels serve every call they take: on plain weights they measured faster than the
# reference's ragged_dot (docs/performance.md, "MoE grouped GEMM kernels"), and on quantized experts
# they read the fp8 or 4-bit weights where the reference first writes a dequantized copy of every
# expert each step.
moe_mlp_op = Op("moe.moe_mlp", reference.moe_mlp,
                (Implementation("grouped", grouped_pallas.moe_mlp, supports=_grouped_supports),))


def route(logits, **options):
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32); see the reference."""
    return route_op(logits, **options)


def moe_mlp(x, expert_ids, expert_weights, gate, up, down, **options):
    """x [T, H] -> [T, H]: each token's experts' MLPs weighted and summed; see the reference."""
    return moe_mlp_op(x, expert_ids, expert_weights, gate, up, down, **options)


__all__ = ["ROUTERS", "gated_activation", "moe_mlp", "route"]
