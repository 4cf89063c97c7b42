"""fp8 x fp8 GEMM in one Pallas kernel (Triton lowering): ``reference.fp8_gemm`` on the fp8 tensor
cores (Hopper's e4m3 ``dot``, float32 accumulation).

x is quantized per token and column group first (``fp8.quantize_activations``: one XLA fusion over
x). The grid walks ``block_m x block_n`` tiles of the output; each program walks the reduction
``block_k`` columns at a time: the ``dot`` of the e4m3 tiles times the tile's activation scales (one
per row) and weight scales (one per output column), added to a float32 accumulator. ``block_k``
divides the activation group, which is the weight's column block, so a tile has one scale per row
and per column; a block whose largest power-of-two factor is under ``MIN_BLOCK_K`` is not taken
(``takes``). The output is rounded to x's dtype, then the bias added in it.

The tiles (``default_blocking``) are the usual Hopper GEMM tiles, capped by the shapes; not yet
measured on a GPU (``scripts/bench_fp8.py``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.kernels.linear import fp8, reference
from jaxinfer.kernels.tiles import load_tile

MIN_BLOCK_K = 32  # an e4m3 tensor-core step reduces 32 values
MAX_BLOCK_K = 128


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class Blocking(NamedTuple):
    block_m: int  # x rows per program
    block_n: int  # weight rows (output columns) per program
    block_k: int  # reduction step, dividing the scale group
    num_warps: int
    num_stages: int


def takes(weight) -> bool:
    """Whether the kernel can tile ``weight``: an fp8 weight with one scale, or blocks whose column
    width has a power-of-two factor of at least ``MIN_BLOCK_K``."""
    return fp8.is_fp8(weight) and (weight.block is None
                                   or fp8.largest_power_of_two_dividing(weight.block[1]) >= MIN_BLOCK_K)


def default_blocking(rows: int, weight) -> Blocking:
    """128 x 128 output tiles (64 rows below 128), 8 warps, 3 stages; the reduction step the widest
    power of two up to 128 that divides the weight's column block (one scale per tensor: up to
    128, capped by the row)."""
    out_features, in_features = weight.shape
    block_k = (min(MAX_BLOCK_K, max(MIN_BLOCK_K, _next_pow2(in_features))) if weight.block is None
               else min(MAX_BLOCK_K, fp8.largest_power_of_two_dividing(weight.block[1])))
    block_m = min(128, max(16, _next_pow2(rows)))
    block_n = min(128, max(16, _next_pow2(out_features)))
    return Blocking(block_m, block_n, block_k, num_warps=8 if block_m * block_n >= 128 * 128 else 4, num_stages=3)


def _check_blocking(blocking: Blocking, weight) -> None:
    if blocking.block_k < MIN_BLOCK_K or blocking.block_k & (blocking.block_k - 1):
        raise ValueError(f"block_k ({blocking.block_k}) must be a power of two of at least {MIN_BLOCK_K}")
    if weight.block is not None and weight.block[1] % blocking.block_k:
        raise ValueError(f"block_k ({blocking.block_k}) must divide the weight's column block ({weight.block[1]})")


def _kernel(x_ref, x_scales_ref, w_ref, w_scales_ref, *rest, rows: int, out_features: int, group: int, w_block,
            block_m: int, block_n: int, block_k: int):
    """One ``[block_m, block_n]`` output tile. ``rows``, ``out_features``: the output's real size (the
    interpreter's operands are padded)."""
    b_ref, out_ref = rest if len(rest) == 2 else (None, rest[0])
    m_size, k_size = x_ref.shape
    n_size = w_ref.shape[0]
    m0, n0 = pl.program_id(0) * block_m, pl.program_id(1) * block_n
    row_ids = m0 + lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    col_ids = n0 + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
    w_scale_rows = col_ids * 0 if w_block is None else col_ids // w_block[0]
    mask_k = k_size % block_k != 0

    def body(kb, acc):
        k0 = kb * block_k
        xs = load_tile(x_ref.at[pl.ds(m0, block_m), pl.ds(k0, block_k)], m0, k0, n_size=m_size, k_size=k_size,
                       mask_n=m_size % block_m != 0, mask_k=mask_k)
        ws = load_tile(w_ref.at[pl.ds(n0, block_n), pl.ds(k0, block_k)], n0, k0, n_size=n_size, k_size=k_size,
                       mask_n=n_size % block_n != 0, mask_k=mask_k)
        g = k0 // group
        x_scale = plgpu.load(x_scales_ref.at[row_ids, row_ids * 0 + g], mask=row_ids < m_size, other=0.0)
        w_col = g if w_block is not None else 0
        w_scale = plgpu.load(w_scales_ref.at[w_scale_rows, w_scale_rows * 0 + w_col],
                             mask=w_scale_rows < w_scales_ref.shape[0], other=0.0)
        return acc + plgpu.dot(xs, ws, trans_b=True) * x_scale[:, None] * w_scale[None, :]

    acc = lax.fori_loop(0, pl.cdiv(k_size, block_k), body, jnp.zeros((block_m, block_n), jnp.float32))
    y = acc.astype(out_ref.dtype)
    if b_ref is not None:
        b = plgpu.load(b_ref.at[col_ids], mask=col_ids < b_ref.shape[0], other=0.0).astype(out_ref.dtype)
        y = (y.astype(jnp.float32) + b.astype(jnp.float32)[None, :]).astype(out_ref.dtype)
    out_rows = m0 + lax.broadcasted_iota(jnp.int32, (block_m, block_n), 0)
    out_cols = n0 + lax.broadcasted_iota(jnp.int32, (block_m, block_n), 1)
    plgpu.store(out_ref.at[out_rows, out_cols], y, mask=(out_rows < rows) & (out_cols < out_features))


def _padded(a, multiples, value=0):
    """``a`` padded at the end of each axis to a multiple of ``multiples`` (None: as it is)."""
    return jnp.pad(a, [(0, _round_up(n, m) - n) if m else (0, 0) for n, m in zip(a.shape, multiples)],
                   constant_values=value)


@functools.partial(jax.jit, static_argnames=("blocking", "interpret"))
def fp8_gemm(x, weight, bias=None, *, blocking: Blocking | None = None, interpret: bool = False):
    """``reference.fp8_gemm``: x [..., K] times the fp8 ``weight`` [N, K] (+ ``bias`` [N]) -> [..., N]
    in x's dtype, as one kernel after x's quantization. ``blocking`` overrides ``default_blocking``."""
    reference.check_fp8_gemm(x, weight, bias)
    if not takes(weight):
        raise ValueError(f"the fp8 GEMM kernel tiles column blocks with a power-of-two factor of at least "
                         f"{MIN_BLOCK_K}; the weight's blocks are {weight.block}")
    k_size, n_size = x.shape[-1], weight.shape[0]
    group = fp8.activation_group(weight)
    x_values, x_scales = fp8.quantize_activations(x.reshape(-1, k_size), group)
    rows = x_values.shape[0]
    blocking = blocking or default_blocking(rows, weight)
    _check_blocking(blocking, weight)
    block_m, block_n, block_k = blocking.block_m, blocking.block_n, blocking.block_k
    w_values, w_scales = weight.values, weight.scales
    if interpret:  # the interpreter touches masked-off addresses: every operand is padded to whole tiles
        x_values, w_values = _padded(x_values, (block_m, block_k)), _padded(w_values, (block_n, block_k))
        x_scales = _padded(x_scales, (block_m, None))
        x_scales = jnp.pad(x_scales, ((0, 0), (0, -(-x_values.shape[1] // group) - x_scales.shape[1])))
        if weight.block is not None:
            covered = [-(-n // b) for n, b in zip(w_values.shape, weight.block)]
            w_scales = jnp.pad(w_scales, [(0, c - s) for c, s in zip(covered, w_scales.shape)])
        bias = None if bias is None else _padded(bias, (block_n,))
    out_shape = jax.ShapeDtypeStruct((x_values.shape[0], w_values.shape[0]), x.dtype)  # padded when interpreted
    inputs = [x_values, x_scales, w_values, w_scales, *([] if bias is None else [bias])]
    whole = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))  # noqa: E731  (indexed in the kernel)
    kernel = functools.partial(_kernel, rows=rows, out_features=n_size, group=group, w_block=weight.block,
                               block_m=block_m, block_n=block_n, block_k=block_k)
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(rows, block_m), pl.cdiv(n_size, block_n)),
        in_specs=[whole(a.shape) for a in inputs],
        out_specs=whole(out_shape.shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=blocking.num_warps, num_stages=blocking.num_stages),
        interpret=interpret,
        name=f"fp8_gemm_{block_m=}_{block_n=}_{block_k=}",
    )(*inputs)
    return out[:rows, :n_size].reshape(*x.shape[:-1], n_size)


__all__ = ["Blocking", "MIN_BLOCK_K", "default_blocking", "fp8_gemm", "takes"]
