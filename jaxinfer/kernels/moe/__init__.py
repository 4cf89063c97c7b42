"""Mixture-of-experts ops: the expert MLPs of routed tokens.

``moe_mlp`` dispatches by platform: the plain-jnp reference (grouped matmuls through
``jax.lax.ragged_dot``, the semantic truth) on CPU, the Pallas grouped-GEMM kernel
(``grouped_pallas.py``) on GPU. ``set_implementation("reference")`` forces the reference.
"""

from __future__ import annotations

import jax

from jaxinfer.kernels.moe import grouped_pallas, reference
from jaxinfer.kernels.moe.reference import gated_activation

_IMPLEMENTATIONS = {"reference": reference.moe_mlp, "pallas": grouped_pallas.moe_mlp}
_PLATFORM_DEFAULT = {"gpu": "pallas", "cuda": "pallas"}
_forced: str | None = None


def set_implementation(name: str | None) -> None:
    """Force one implementation (``None`` goes back to the per-platform default)."""
    if name is not None and name not in _IMPLEMENTATIONS:
        raise ValueError(f"unknown MoE implementation {name!r}; known: {sorted(_IMPLEMENTATIONS)}")
    global _forced
    _forced = name


def implementation_name() -> str:
    return _forced or _PLATFORM_DEFAULT.get(jax.default_backend(), "reference")


def moe_mlp(x, expert_ids, expert_weights, gate, up, down, **options):
    return _IMPLEMENTATIONS[implementation_name()](x, expert_ids, expert_weights, gate, up, down, **options)


__all__ = ["gated_activation", "implementation_name", "moe_mlp", "set_implementation"]
