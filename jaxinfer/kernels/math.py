"""Plain-jnp building blocks shared by the models and the kernels' references, with HF's dtype
semantics: RMSNorm and rotary position embeddings."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x, weight, eps: float, *, unit_offset: bool = False, float32_weight: bool = False):
    """RMSNorm over the last axis, normalised in float32.

    ``unit_offset=False`` (Llama, Qwen, Mistral): ``weight * x_normed.astype(input_dtype)``; with
    ``float32_weight`` (GPT-OSS) the product is taken in float32 and cast back. ``unit_offset=True``
    (Gemma, Qwen3-Next): ``x_normed * (1 + weight)`` in float32, cast back.
    """
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return apply_norm_weight(x32, weight, x.dtype, unit_offset=unit_offset, float32_weight=float32_weight)


def apply_norm_weight(normed, weight, dtype, *, unit_offset: bool = False, float32_weight: bool = False):
    """``rms_norm``'s last step: the float32 normalised rows times the weight, as HF rounds it, in ``dtype``."""
    if unit_offset:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(dtype)
    if float32_weight:
        return (weight.astype(jnp.float32) * normed).astype(dtype)
    return weight * normed.astype(dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rotary(x, cos, sin):
    """Rotates the first ``cos.shape[-1]`` dims of ``x`` [T, heads, head_dim]; the rest pass through.

    cos/sin [T, rotary_dim] are cast to x's dtype first, as HF does.
    """
    rotary_dim = cos.shape[-1]
    cos = cos.astype(x.dtype)[:, None, :]
    sin = sin.astype(x.dtype)[:, None, :]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    x_rot = x_rot * cos + rotate_half(x_rot) * sin
    return jnp.concatenate([x_rot, x_pass], axis=-1) if x_pass.shape[-1] else x_rot


def apply_rotary_interleaved(x, cos, sin):
    """RoPE over interleaved pairs ``(x0, x1), (x2, x3), ...`` of ``x`` [T, heads, rotary_dim] (DeepSeek's
    layout), returned de-interleaved as HF returns it: ``[rot(evens) | rot(odds)]`` (dot products
    between rotated vectors are the same either way). cos/sin [T, rotary_dim] in HF's
    ``cat(freqs, freqs)`` layout, cast to x's dtype first."""
    half = cos.shape[-1] // 2
    cos = cos[:, :half].astype(x.dtype)[:, None, :]
    sin = sin[:, :half].astype(x.dtype)[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
