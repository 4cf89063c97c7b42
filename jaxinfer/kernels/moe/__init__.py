"""Mixture-of-experts ops: routing and the expert MLPs of routed tokens.

``route`` and ``moe_mlp`` dispatch by platform: the plain-jnp reference (``reference.py``, the
semantic truth; grouped matmuls through ``jax.lax.ragged_dot``) on CPU, the Pallas kernels on GPU
(``router_pallas.py``: scoring, top-k and weights in one launch, used at the sizes where it measured
faster; ``grouped_pallas.py``: the grouped GEMMs). ``set_implementation("reference")`` forces the
reference.
"""

from __future__ import annotations

from jaxinfer.kernels.dispatch import OpDispatcher
from jaxinfer.kernels.moe import grouped_pallas, reference, router_pallas
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


_dispatch = OpDispatcher(
    "MoE",
    {"reference": {"moe_mlp": reference.moe_mlp, "route": reference.route},
     "pallas": {"moe_mlp": grouped_pallas.moe_mlp, "route": _route_where_faster}},
    {"gpu": "pallas", "cuda": "pallas"},
)
set_implementation = _dispatch.set_implementation
implementation_name = _dispatch.implementation_name


def route(logits, **options):
    return _dispatch("route")(logits, **options)


def moe_mlp(x, expert_ids, expert_weights, gate, up, down, **options):
    return _dispatch("moe_mlp")(x, expert_ids, expert_weights, gate, up, down, **options)


__all__ = ["ROUTERS", "gated_activation", "implementation_name", "moe_mlp", "route", "set_implementation"]
