"""Tiles of stacked expert weights as the grouped MoE kernels read them: plain arrays, fp8 with block
or per-tensor scales (``Fp8Weight``), or MXFP4 (``Mxfp4Weight``), dequantized in registers.

A kernel multiplies rows of its left-hand side (``x`` or the hidden) by ``[block_n, block_k]`` tiles of
an ``[E, N, K]`` weight, walking ``K``. Per format, ``lhs_pieces`` says which columns of the left-hand
side one ``K`` step takes and ``weight_pieces`` gives the matching weight tiles in the compute dtype,
so that a step's product is ``sum(dot(lhs_piece, w_piece.T))``:

* plain: one piece, the tile as stored;
* fp8: one piece, each value times its block's scale in float32, then the compute dtype (the
  reference's rounding). ``block_k`` divides the scale block's width, so a tile's rows each take one
  scale (gathered per row: a scale block's height may be anything, its last block ragged);
* MXFP4: two pieces of ``block_k / 2`` columns, the low nibbles (even columns) and the high nibbles
  (odd columns) of the packed bytes, against the even and odd columns of the left-hand side. The
  e2m1 codes decode by arithmetic and selects, and the e8m0 exponents become their powers of two
  by building the float32 bits (no table gather). ``block_k`` is a multiple of the 32-value group.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.kernels.tiles import load_tile
from jaxinfer.quantization import MXFP4_GROUP, Fp8Weight, Mxfp4Weight

PLAIN, FP8, MXFP4 = "plain", "fp8", "mxfp4"
MIN_BLOCK = 16  # the smallest dot operand dimension


class ExpertFormat(NamedTuple):
    """How a stacked weight is stored: ``kind`` (``plain``, ``fp8``, ``mxfp4``) and an fp8 weight's
    scale block (None: one scale per expert's tensor)."""

    kind: str
    block: tuple[int, int] | None = None


def format_of(weight) -> ExpertFormat:
    if isinstance(weight, Fp8Weight):
        return ExpertFormat(FP8, weight.block)
    if isinstance(weight, Mxfp4Weight):
        return ExpertFormat(MXFP4)
    return ExpertFormat(PLAIN)


def problem(weight, name: str) -> str | None:
    """Why the grouped kernels cannot read ``weight`` as stored (None: they can)."""
    fmt = format_of(weight)
    if fmt.kind == FP8:
        e, n, k = weight.shape
        if weight.values.dtype != jnp.float8_e4m3fn or weight.scales.dtype != jnp.float32:
            return f"{name}: fp8 values must be float8_e4m3fn with float32 scales"
        want = (e, 1, 1) if fmt.block is None else (e, -(-n // fmt.block[0]), -(-k // fmt.block[1]))
        if weight.scales.shape != want:
            return f"{name}: fp8 scales {weight.scales.shape} for values {weight.shape} must be {want}"
        if fmt.block is not None and fmt.block[1] % MIN_BLOCK:
            return (f"{name}: a scale block {fmt.block[1]} wide cannot be tiled along K (a multiple of "
                    f"{MIN_BLOCK} is needed)")
    if fmt.kind == MXFP4:
        if weight.blocks.dtype != jnp.uint8 or weight.scales.dtype != jnp.uint8:
            return f"{name}: MXFP4 blocks and scales must be uint8"
        if weight.blocks.shape[-1] != MXFP4_GROUP // 2 or weight.scales.shape != weight.blocks.shape[:-1]:
            return (f"{name}: MXFP4 blocks {weight.blocks.shape} and scales {weight.scales.shape} must be "
                    f"[E, N, G, {MXFP4_GROUP // 2}] and [E, N, G]")
    return None


def fit_block_k(fmt: ExpertFormat, block_k: int) -> int:
    """The default ``K`` step ``block_k`` made to fit the format: within one fp8 scale column, whole
    MXFP4 groups."""
    if fmt.kind == FP8 and fmt.block is not None:
        while block_k > MIN_BLOCK and fmt.block[1] % block_k:
            block_k //= 2
    if fmt.kind == MXFP4:
        block_k = max(block_k, MXFP4_GROUP)
    return block_k


def block_k_problem(fmt: ExpertFormat, block_k: int) -> str | None:
    """Why a ``K`` step of ``block_k`` does not fit the format (None: it does)."""
    if fmt.kind == FP8 and fmt.block is not None and fmt.block[1] % block_k:
        return f"block_k {block_k} must divide the fp8 scale block's width {fmt.block[1]}"
    if fmt.kind == MXFP4 and block_k % MXFP4_GROUP:
        return f"block_k {block_k} must be a multiple of the MXFP4 group ({MXFP4_GROUP})"
    return None


def kernel_inputs(weight) -> list:
    """The arrays a kernel takes for ``weight``: the plain weight; fp8 values and flat scales; MXFP4
    bytes ``[E, N, K / 2]`` and exponents ``[E * N, K / 32]``."""
    fmt = format_of(weight)
    if fmt.kind == FP8:
        return [weight.values, weight.scales.reshape(-1)]
    if fmt.kind == MXFP4:
        e, n, k = weight.shape
        return [weight.blocks.reshape(e, n, k // 2), weight.scales.reshape(e * n, k // MXFP4_GROUP)]
    return [weight]


def lhs_pieces(fmt: ExpertFormat, k0, block_k: int) -> list[tuple]:
    """The left-hand side's columns of one ``K`` step from ``k0``: (first, stride, count) per piece."""
    if fmt.kind == MXFP4:
        return [(k0, 2, block_k // 2), (k0 + 1, 2, block_k // 2)]
    return [(k0, 1, block_k)]


def weight_pieces(refs, fmt: ExpertFormat, e, n0, k0, *, block_n: int, block_k: int, n_size: int, k_size: int,
                  mask_n: bool, mask_k: bool, dtype) -> list:
    """The ``[block_n, width]`` tiles of expert ``e``'s weight at rows ``n0``, step ``k0``, in ``dtype``,
    matching ``lhs_pieces`` (zeros past ``n_size`` / ``k_size`` where masked)."""
    if fmt.kind == MXFP4:
        return _mxfp4_pieces(refs, e, n0, k0, block_n=block_n, block_k=block_k, n_size=n_size, k_size=k_size,
                             mask_n=mask_n, mask_k=mask_k, dtype=dtype)
    tile = load_tile(refs[0].at[e, pl.ds(n0, block_n), pl.ds(k0, block_k)], n0, k0, n_size=n_size, k_size=k_size,
                     mask_n=mask_n, mask_k=mask_k)
    if fmt.kind == PLAIN:
        return [tile.astype(dtype)]
    scales_ref = refs[1]
    if fmt.block is None:
        scale = scales_ref[e]
    else:
        b0, b1 = fmt.block
        rows = n0 + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
        per_expert, cols = -(-n_size // b0), -(-k_size // b1)
        index = (e * per_expert + rows // b0) * cols + k0 // b1
        scale = plgpu.load(scales_ref.at[index], mask=rows < n_size, other=0.0) if mask_n else \
            plgpu.load(scales_ref.at[index])
        scale = scale[:, None]
    return [(tile.astype(jnp.float32) * scale).astype(dtype)]


def _e2m1(code):
    """e2m1 codes (int32 in [0, 16): sign, 2 exponent bits, 1 mantissa bit) as float32 values."""
    exponent = (code >> 1) & 3
    half = (code & 1).astype(jnp.float32) * 0.5
    power = jnp.where(exponent == 3, 4.0, jnp.where(exponent == 2, 2.0, 1.0))
    magnitude = jnp.where(exponent == 0, half, (1.0 + half) * power)
    return jnp.where(code >= 8, -magnitude, magnitude)


def _power_of_two(exponent):
    """``2 ** (exponent - 127)`` (uint8 e8m0 exponents as int32) as float32, built from its bits."""
    bits = jnp.where(exponent == 0, 1 << 22, exponent << 23)  # 2 ** -127 is a subnormal
    return lax.bitcast_convert_type(bits, jnp.float32)


def _mxfp4_pieces(refs, e, n0, k0, *, block_n: int, block_k: int, n_size: int, k_size: int, mask_n: bool,
                  mask_k: bool, dtype) -> list:
    bytes_ref, exponents_ref = refs
    half = block_k // 2
    shape = (block_n, half)
    rows = n0 + lax.broadcasted_iota(jnp.int32, shape, 0)
    cols = k0 // 2 + lax.broadcasted_iota(jnp.int32, shape, 1)  # byte columns
    mask = None
    if mask_n:
        mask = rows < n_size
    if mask_k:
        mask = (cols < k_size // 2) if mask is None else mask & (cols < k_size // 2)
    view = bytes_ref.at[e, pl.ds(n0, block_n), pl.ds(k0 // 2, half)]
    packed = (view[...] if mask is None else plgpu.load(view, mask=mask, other=0)).astype(jnp.int32)
    groups = exponents_ref.at[e * n_size + rows, cols // (MXFP4_GROUP // 2)]
    exponent = plgpu.load(groups) if mask is None else plgpu.load(groups, mask=mask, other=127)
    exponent = exponent.astype(jnp.int32)
    scale = _power_of_two(exponent)
    return [(_e2m1(packed & 15) * scale).astype(dtype), (_e2m1(packed >> 4) * scale).astype(dtype)]


__all__ = ["ExpertFormat", "block_k_problem", "fit_block_k", "format_of", "kernel_inputs", "lhs_pieces", "problem",
           "weight_pieces"]
