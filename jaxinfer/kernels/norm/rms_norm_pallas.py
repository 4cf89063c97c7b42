"""Residual add + RMSNorm in one Pallas (Triton lowering) kernel.

XLA makes an RMSNorm two kernels (the sum of squares, then the scaling), and the residual add joins
the first; at batch 1 each is a launch of its own for a few KB. Here one program takes
a few whole rows: it adds the residual (rounded to the activations' dtype, as HF adds), writes the
sum, and normalises it in float32. A hidden size that is not a power of two is padded inside the
kernel (masked loads and stores), not in memory; the masked lanes keep their own indices (not
clamped), so that Triton sees each row as contiguous and vectorises its loads. Its timings against
XLA's kernels are in docs/performance.md, "Residual add + RMSNorm kernel".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.kernels import pdl
from jaxinfer.kernels.norm import reference

# Rows per program: this many elements (at least one row), so that a few dozen rows already spread
# over dozens of SMs.
_ELEMENTS_PER_PROGRAM = 4096


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kernel(*refs, eps, unit_offset, float32_weight, has_residual, num_rows, hidden, block_rows, block_hidden):
    if has_residual:
        x_ref, residual_ref, weight_ref, out_ref, sum_ref = refs
    else:
        x_ref, weight_ref, out_ref = refs
    shape = (block_rows, block_hidden)
    row = pl.program_id(0) * block_rows + lax.broadcasted_iota(jnp.int32, shape, 0)
    col = lax.broadcasted_iota(jnp.int32, shape, 1)
    mask = (row < num_rows) & (col < hidden)
    # Unclamped indices keep the columns visibly contiguous to Triton (vector loads); the masked-off
    # ones are never read or written.
    index = (row, col)
    x = plgpu.load(x_ref.at[index], mask=mask, other=0.0)
    if has_residual:
        x = x + plgpu.load(residual_ref.at[index], mask=mask, other=0.0)
        plgpu.store(sum_ref.at[index], x, mask=mask)
    w_col = lax.broadcasted_iota(jnp.int32, (block_hidden,), 0)
    weight = plgpu.load(weight_ref.at[w_col], mask=w_col < hidden, other=0.0)[None, :]
    x32 = x.astype(jnp.float32)
    x32 = x32 * lax.rsqrt((x32 * x32).sum(axis=1, keepdims=True) / hidden + eps)
    if unit_offset:
        out = x32 * (1.0 + weight.astype(jnp.float32))
    elif float32_weight:
        out = weight.astype(jnp.float32) * x32
    else:
        out = weight * x32.astype(x.dtype)
    plgpu.store(out_ref.at[index], out.astype(out_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("eps", "unit_offset", "float32_weight", "interpret"))
def add_rms_norm(x, residual, weight, eps: float, *, unit_offset: bool = False, float32_weight: bool = False,
                 interpret: bool = False):
    """``reference.add_rms_norm`` in one kernel: ``(rms_norm(x + residual), x + residual)``."""
    if residual is not None and residual.dtype != x.dtype:
        raise ValueError(f"the residual is {residual.dtype} and x is {x.dtype}; add_rms_norm wants one dtype")
    shape = x.shape
    hidden = shape[-1]
    x2 = x.reshape(-1, hidden)
    num_rows = x2.shape[0]
    if num_rows == 0:  # no rows, no launch (a grid of zero programs)
        return reference.add_rms_norm(x, residual, weight, eps, unit_offset=unit_offset,
                                      float32_weight=float32_weight)
    block_hidden = _next_pow2(hidden)
    block_rows = min(_next_pow2(num_rows), max(1, _ELEMENTS_PER_PROGRAM // block_hidden))
    inputs = [x2] + ([residual.reshape(-1, hidden)] if residual is not None else []) + [weight]
    # On the GPU, the rows and columns past the ends are masked off. The interpreter reads and
    # rewrites masked addresses, which must exist: there the arrays are padded to whole blocks.
    padded_rows = pl.cdiv(num_rows, block_rows) * block_rows
    if interpret:
        inputs = [jnp.pad(a, [(0, padded_rows - num_rows)] * (a.ndim - 1) + [(0, block_hidden - hidden)])
                  for a in inputs]
    # The reference's dtype: x's, or x's promoted with the weight's when the weight multiplies last.
    out_dtype = x.dtype if unit_offset or float32_weight else jnp.promote_types(weight.dtype, x.dtype)
    out_rows_cols = (padded_rows, block_hidden) if interpret else x2.shape
    out_shape = [jax.ShapeDtypeStruct(out_rows_cols, out_dtype)]
    if residual is not None:
        out_shape.append(jax.ShapeDtypeStruct(out_rows_cols, x.dtype))
    whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)  # noqa: E731  (rows are indexed in the kernel)
    kernel = functools.partial(_kernel, eps=eps, unit_offset=unit_offset, float32_weight=float32_weight,
                               has_residual=residual is not None, num_rows=num_rows, hidden=hidden,
                               block_rows=block_rows, block_hidden=block_hidden)
    outputs = pl.pallas_call(
        pdl.with_trigger(kernel, "rms_norm", interpret=interpret),
        grid=(pl.cdiv(num_rows, block_rows),),
        in_specs=[whole(a) for a in inputs],
        out_specs=[whole(o) for o in out_shape],
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4 if block_rows * block_hidden <= 4096 else 8, num_stages=1),
        interpret=interpret,
        name="add_rms_norm",
    )(*inputs)
    outputs = [o[:num_rows, :hidden].reshape(shape) for o in outputs]
    return outputs[0], (outputs[1] if residual is not None else x)
