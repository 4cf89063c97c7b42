"""Mixture-of-experts ops: the expert MLPs of routed tokens.

``moe_mlp`` dispatches by platform: the plain-jnp reference (grouped matmuls through
``jax.lax.ragged_dot``, the semantic truth) on CPU, the Pallas grouped-GEMM kernel
(``grouped_pallas.py``) on GPU. ``set_implementation("reference")`` forces the reference.
"""

from __future__ import annotations

from jaxinfer.kernels.dispatch import OpDispatcher
from jaxinfer.kernels.moe import grouped_pallas, reference
from jaxinfer.kernels.moe.reference import gated_activation

_dispatch = OpDispatcher("MoE", {"reference": {"moe_mlp": reference.moe_mlp},
                                 "pallas": {"moe_mlp": grouped_pallas.moe_mlp}}, {"gpu": "pallas", "cuda": "pallas"})
set_implementation = _dispatch.set_implementation
implementation_name = _dispatch.implementation_name


def moe_mlp(x, expert_ids, expert_weights, gate, up, down, **options):
    return _dispatch("moe_mlp")(x, expert_ids, expert_weights, gate, up, down, **options)


__all__ = ["gated_activation", "implementation_name", "moe_mlp", "set_implementation"]
