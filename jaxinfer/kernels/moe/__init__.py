"""Mixture-of-experts ops. Today every platform runs the plain-jnp reference (grouped matmuls through
``jax.lax.ragged_dot``); the GPU grouped-GEMM kernel plugs in behind the same signature."""

from jaxinfer.kernels.moe.reference import gated_activation, moe_mlp

__all__ = ["gated_activation", "moe_mlp"]
