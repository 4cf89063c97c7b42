"""Linear projections in plain jnp: the semantic truth for the kernel.

``project`` applies several projections of one input at once (e.g. an attention block's q, k and v),
each exactly as ``nn.Linear`` does in HF: ``x @ weight.T`` in x's dtype, then the bias added in that
dtype. Weights keep the checkpoint's ``[out_features, in_features]`` layout; an fp8 weight
(``Fp8Weight``) is dequantized to x's dtype first (each value times its block's scale in float32,
then rounded): the weight HF's model holds. ``norm_project`` is a pre-norm block's residual add
and RMSNorm followed by its first projections.

``fp8_gemm`` is not the model's semantics: it quantizes the activations to fp8 too (per token and
column group), as fp8 tensor-core GEMMs (DeepSeek's, vLLM's) compute; it is the truth for their
kernel, and runs only where a caller opts in (``jaxinfer.kernels.linear.quantized_activations``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxinfer.kernels.linear import fp8
from jaxinfer.kernels.norm.reference import add_rms_norm


def check_projections(x, weights, biases) -> None:
    if biases is not None and len(biases) != len(weights):
        raise ValueError(f"{len(weights)} weights but {len(biases)} biases (give None for a projection without one)")
    for i, w in enumerate(weights):
        if fp8.is_fp8(w):
            fp8.check_weight(i, w)
        if len(w.shape) != 2 or w.shape[1] != x.shape[-1]:
            raise ValueError(f"weight {i} is {w.shape}; it must be [out_features, {x.shape[-1]}] for x {x.shape}")
        b = None if biases is None else biases[i]
        if b is not None and b.shape != (w.shape[0],):
            raise ValueError(f"bias {i} is {b.shape}; it must be [{w.shape[0]}]")


def project(x, weights, biases=None):
    """x [..., K]; weights: a sequence of [N_i, K] (plain or ``Fp8Weight``); biases: None or a
    sequence of [N_i] or None -> a tuple of [..., N_i] in x's dtype."""
    check_projections(x, weights, biases)
    outputs = []
    for i, w in enumerate(weights):
        y = jax.lax.dot_general(x, fp8.dense(w, x.dtype), (((x.ndim - 1,), (1,)), ((), ())))
        b = None if biases is None else biases[i]
        outputs.append(y if b is None else y + b.astype(y.dtype))
    return tuple(outputs)


def norm_project(x, residual, norm_weight, weights, biases=None, *, eps: float, unit_offset: bool = False,
                 float32_weight: bool = False):
    """``normed, summed = add_rms_norm(x, residual, norm_weight, eps, ...)`` (``residual=None``: ``x``
    alone), then ``(project(normed, weights, biases), summed)``: the projections and the residual
    stream after the add."""
    normed, summed = add_rms_norm(x, residual, norm_weight, eps, unit_offset=unit_offset,
                                  float32_weight=float32_weight)
    return project(normed, weights, biases), summed


def check_fp8_gemm(x, weight, bias) -> None:
    if not fp8.is_fp8(weight):
        raise ValueError(f"fp8_gemm takes an Fp8Weight, got {type(weight).__name__}")
    check_projections(x, (weight,), (bias,))
    if x.shape[-1] == 0:
        raise ValueError(f"x {x.shape} has no input features to project")


def fp8_gemm(x, weight, bias=None):
    """x [..., K] times an fp8 ``weight`` [N, K] as an fp8 x fp8 GEMM: x quantized per token and
    ``fp8.activation_group(weight)`` columns (``fp8.quantize_activations``); per column group, the
    e4m3 products summed in float32, times the group's activation scale and the weight block's
    scale, added in float32; rounded to x's dtype, then ``bias`` added in it. -> [..., N]."""
    check_fp8_gemm(x, weight, bias)
    k_size, n_size = x.shape[-1], weight.shape[0]
    group = fp8.activation_group(weight)
    x_values, x_scales = fp8.quantize_activations(x.reshape(-1, k_size), group)
    groups = x_scales.shape[1]
    pad = groups * group - k_size
    x_values = jnp.pad(x_values, ((0, 0), (0, pad)))
    w_values = jnp.pad(weight.values, ((0, 0), (0, pad)))
    w_scales = weight.scales  # [row blocks, groups], or [1, 1]: each output column's scale per group
    if weight.block is not None:
        w_scales = jnp.repeat(w_scales, weight.block[0], axis=0)[:n_size]

    def add_group(g, acc):
        xg = lax.dynamic_slice_in_dim(x_values, g * group, group, axis=1)
        wg = lax.dynamic_slice_in_dim(w_values, g * group, group, axis=1)
        part = lax.dot_general(xg, wg, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        w_scale = lax.dynamic_slice_in_dim(w_scales, g if weight.block is not None else 0, 1, axis=1)[:, 0]
        return acc + part * x_scales[:, g][:, None] * w_scale[None, :]

    acc = lax.fori_loop(0, groups, add_group, jnp.zeros((x_values.shape[0], n_size), jnp.float32))
    y = acc.astype(x.dtype).reshape(*x.shape[:-1], n_size)
    return y if bias is None else y + bias.astype(y.dtype)
