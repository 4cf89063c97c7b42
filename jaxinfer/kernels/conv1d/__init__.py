"""Depthwise causal conv1d ops over packed sequences with a per-sequence state of the last ``K - 1``
inputs: ``causal_conv1d`` for a step's new tokens, ``causal_conv1d_step`` for one token per sequence.
The plain-jnp reference (``reference.py``) serves every platform for now (``jaxinfer.kernels.registry``).
"""

from __future__ import annotations

from jaxinfer.kernels.conv1d import reference
from jaxinfer.kernels.registry import Op

causal_conv1d_op = Op("conv1d.causal_conv1d", reference.causal_conv1d)
causal_conv1d_step_op = Op("conv1d.causal_conv1d_step", reference.causal_conv1d_step)


def causal_conv1d(x, weight, bias, cu_seqlens, initial_state, *, activation: str | None = "silu"):
    """-> (y [T, C], final states [S, K - 1, C]); see the reference."""
    return causal_conv1d_op(x, weight, bias, cu_seqlens, initial_state, activation=activation)


def causal_conv1d_step(x, weight, bias, state, *, activation: str | None = "silu"):
    """-> (y [S, C], the new state); see the reference."""
    return causal_conv1d_step_op(x, weight, bias, state, activation=activation)


__all__ = ["causal_conv1d", "causal_conv1d_step"]
