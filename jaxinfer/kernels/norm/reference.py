"""RMSNorm with the residual add before it, in plain jnp: the semantic truth for the kernel.

A pre-norm decoder adds each block's output to the residual stream and normalises the sum for the
next block. HF adds in the activations' dtype and then normalises; so does this.
"""

from __future__ import annotations

from jaxinfer.kernels.math import rms_norm


def add_rms_norm(x, residual, weight, eps: float, *, unit_offset: bool = False, float32_weight: bool = False):
    """``(rms_norm(x + residual), x + residual)``; with ``residual=None``, ``(rms_norm(x), x)``.

    ``x`` and ``residual`` are ``[..., hidden]`` of one dtype; the norm's options are
    ``jaxinfer.kernels.math.rms_norm``'s.
    """
    summed = x if residual is None else x + residual
    return rms_norm(summed, weight, eps, unit_offset=unit_offset, float32_weight=float32_weight), summed
