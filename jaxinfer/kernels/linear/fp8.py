"""fp8 weights (``jaxinfer.quantization.Fp8Weight``) in the projection ops: their checks, their dense
form (the semantic reference), the reduction tiles that keep a tile inside one scale block, and the
per-token-group activation quantization of ``fp8_gemm``.

A block-scaled weight's scale changes every ``block[1]`` columns, so a kernel that applies one scale
per weight row of a tile needs its reduction tile to divide ``block[1]``; Triton tiles are powers of
two, so the tile is at most the largest power of two dividing ``block[1]`` (``aligned_block_k``).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfer.quantization import Fp8Weight

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
# vLLM's floor on a group's largest magnitude, so an all-zero group still gets a finite scale.
ACTIVATION_AMAX_FLOOR = 1e-10


def is_fp8(weight) -> bool:
    return isinstance(weight, Fp8Weight)


def any_fp8(weights) -> bool:
    return any(is_fp8(w) for w in weights)


def check_weight(i: int, weight: Fp8Weight) -> None:
    """``ValueError`` naming weight ``i`` unless it is a 2-D e4m3 weight with float32 scales of the
    shape its block size gives (``[1, 1]`` for one scale per tensor)."""
    if weight.values.ndim != 2:
        raise ValueError(f"fp8 weight {i} is {weight.values.shape}; a projection takes [out_features, in_features]")
    if weight.values.dtype != E4M3:
        raise ValueError(f"fp8 weight {i} holds {weight.values.dtype} values; expected float8_e4m3fn")
    if weight.scales.dtype != jnp.float32:
        raise ValueError(f"fp8 weight {i} has {weight.scales.dtype} scales; expected float32")
    rows, cols = weight.values.shape
    want = (1, 1) if weight.block is None else (-(-rows // weight.block[0]), -(-cols // weight.block[1]))
    if weight.scales.shape != want:
        blocks = "one scale per tensor" if weight.block is None else f"blocks of {weight.block}"
        raise ValueError(f"fp8 weight {i} [{rows}, {cols}] in {blocks} needs scales {list(want)}, got "
                         f"{list(weight.scales.shape)}")


def dense(weight, dtype):
    """The weight as a plain ``dtype`` array: an fp8 one dequantized (``Fp8Weight.dequantize``)."""
    return weight.dequantize(dtype) if is_fp8(weight) else weight.astype(dtype)


def largest_power_of_two_dividing(n: int) -> int:
    return n & -n


def aligned_block_k(weights, limit: int) -> int:
    """The largest power of two up to ``limit`` (a power of two) dividing every block-scaled fp8
    weight's column block: a reduction tile of that width never straddles two scale blocks."""
    for w in weights:
        if is_fp8(w) and w.block is not None:
            limit = min(limit, largest_power_of_two_dividing(w.block[1]))
    return limit


def activation_group(weight: Fp8Weight) -> int:
    """The columns that share one activation scale in ``fp8_gemm``: the weight's column block, or the
    whole row for a weight with one scale."""
    return weight.block[1] if weight.block is not None else weight.values.shape[1]


def quantize_activations(x, group: int):
    """x [M, K] -> (e4m3 values [M, K], float32 scales [M, ceil(K / group)]): per row and ``group``
    columns (the last group ragged), ``scale = max(|x|) / 448`` and ``values = x / scale`` in
    float32, rounded to e4m3 (DeepSeek's and vLLM's per-token-group quantization)."""
    rows, cols = x.shape
    groups = -(-cols // group)
    padded = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, groups * group - cols))).reshape(rows, groups, group)
    scales = jnp.maximum(jnp.max(jnp.abs(padded), axis=-1), ACTIVATION_AMAX_FLOOR) / E4M3_MAX
    values = jnp.clip(padded / scales[..., None], -E4M3_MAX, E4M3_MAX).astype(E4M3)
    return values.reshape(rows, groups * group)[:, :cols], scales
