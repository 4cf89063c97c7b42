"""Few-row projections in one Pallas kernel (Triton lowering), same semantics as ``reference.project``.

At a decode step a projection is a matrix-vector product: its whole cost is reading the weight once.
XLA turns ``x @ W.T`` with one row into reduction kernels (an attention block's q, k and v took two
inside a Qwen3 layer, the k/v one at well under full bandwidth). Here one launch
covers every weight given: the grid walks the output columns of all of them, each program takes
``block_n`` rows of one weight (contiguous in the ``[N, K]`` layout) and streams them ``block_k`` at a
time through the software pipeline, against the few rows of ``x``.

- One row: the product is elementwise in float32 (``[block_n, block_k]`` partial sums, reduced once at
  the end), so ``block_n`` can be as small as it takes to give every SM several programs.
- More rows (up to ``MAX_ROWS``): ``dot`` on the tensor cores, ``x``'s rows padded (masked) to 16.

The products of bf16 values are exact in float32 and sum in float32, as XLA's matmul does; only the
order of the sum differs. The output is rounded to ``x``'s dtype, then the bias is added in it.

``norm_project`` is the same kernel at one row with the RMSNorm before it folded in: the row's
inverse RMS scales the outputs at the end, so no program waits for the norm before its weight loads.

fp8 weights (``Fp8Weight``, mixed with plain ones in one launch) are read as stored, half the bytes
of bf16: each tile's e4m3 values times their scales in float32, rounded to x's dtype in registers,
which is the reference's dequantized weight exactly. The reduction tile divides every block-scaled
weight's column block (``fp8.aligned_block_k``), so one scale serves each weight row of a tile;
block sizes whose largest power-of-two factor is under ``MIN_BLOCK_K`` are not taken
(``takes_weights``). Per-tensor scales put no limit on the tile.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.kernels import pdl
from jaxinfer.kernels.linear import fp8, reference
from jaxinfer.kernels.tiles import load_tile

MAX_ROWS = 16  # the most rows of x the kernel takes (the dispatcher uses it at one row: see __init__.py)
MIN_BLOCK_K = 16  # the narrowest reduction tile (the tensor-core dot's minimum)
MAX_ALIGNED_BLOCK_N = 16  # the most weight rows per program when an fp8 block narrows the reduction tile


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class Blocking(NamedTuple):
    block_n: int  # weight rows (output columns) per program
    block_k: int  # reduction step
    num_warps: int
    num_stages: int


def default_blocking(rows: int, in_features: int) -> Blocking:
    """One row: 4 weight rows by 1024 columns per step (thousands of programs, each a few long
    contiguous reads); more rows: 16 by 256, the tensor-core tile. 4 warps, 3 stages. The one-row
    blocking was chosen by a sweep on the H200: docs/performance.md, "Few-row projection kernel".
    """
    if rows == 1:
        return Blocking(4, min(1024, max(MIN_BLOCK_K, _next_pow2(in_features))), num_warps=4, num_stages=3)
    return Blocking(16, min(256, max(MIN_BLOCK_K, _next_pow2(in_features))), num_warps=4, num_stages=3)


def default_norm_blocking(in_features: int) -> Blocking:
    """``norm_project``'s blocking: a row of up to 2048 columns in one step of 8 weight rows (no
    reduction loop, so nothing to pipeline); wider rows as ``default_blocking(1, ...)``, since the
    same blocks over a 4096-wide row measured slower (docs/performance.md, "Few-row projection
    kernel").
    """
    width = _next_pow2(in_features)
    if width <= 2048:
        return Blocking(8, max(MIN_BLOCK_K, width), num_warps=4, num_stages=1)
    return default_blocking(1, in_features)


def takes_weights(weights) -> bool:
    """Whether a reduction tile of at least ``MIN_BLOCK_K`` columns fits inside one scale block of
    every block-scaled fp8 weight (plain and per-tensor weights always fit)."""
    return fp8.aligned_block_k(weights, MIN_BLOCK_K) == MIN_BLOCK_K


def aligned_blocking(blocking: Blocking, weights) -> Blocking:
    """``blocking`` with its reduction tile narrowed to fit one scale block of every block-scaled fp8
    weight, and its weight rows per program multiplied as the tile narrowed (up to
    ``MAX_ALIGNED_BLOCK_N``) so that a step still loads about as many values; pipelined, since the
    narrower tile makes a reduction loop. Not yet measured on a GPU (``scripts/bench_fp8.py`` sweeps
    it)."""
    block_k = fp8.aligned_block_k(weights, blocking.block_k)
    if block_k == blocking.block_k:
        return blocking
    if block_k < MIN_BLOCK_K:
        raise ValueError(f"an fp8 weight's column block has no power-of-two factor of at least {MIN_BLOCK_K}: "
                         f"blocks {[w.block for w in weights if fp8.is_fp8(w)]}")
    block_n = max(blocking.block_n, min(MAX_ALIGNED_BLOCK_N, blocking.block_n * (blocking.block_k // block_k)))
    return Blocking(block_n, block_k, blocking.num_warps, max(blocking.num_stages, 3))


def _check_aligned(blocking: Blocking, weights) -> Blocking:
    for i, w in enumerate(weights):
        if fp8.is_fp8(w) and w.block is not None and w.block[1] % blocking.block_k:
            raise ValueError(f"block_k ({blocking.block_k}) must divide fp8 weight {i}'s column block "
                             f"({w.block[1]}): a tile takes one scale per weight row")
    return blocking


class _WeightRefs(NamedTuple):
    """A weight as the kernel reads it: its values, and for an fp8 weight its scales and block."""

    values: object
    scales: object = None
    block: tuple[int, int] | None = None


def _row_scales(w: _WeightRefs, n0, k0, *, block_n: int):
    """[block_n, 1]: the scale of each weight row of the tile at (n0, k0), which lies inside one
    column block (``aligned_blocking``)."""
    rows = n0 + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
    if w.block is None:
        scale_rows, scale_cols = rows * 0, rows * 0
    else:
        scale_rows, scale_cols = rows // w.block[0], rows * 0 + k0 // w.block[1]
    scales = plgpu.load(w.scales.at[scale_rows, scale_cols], mask=scale_rows < w.scales.shape[0], other=1.0)
    return scales[:, None]


def _weight_block(w: _WeightRefs, n0, k0, *, block_n: int, block_k: int, dtype):
    """``w[n0:n0+block_n, k0:k0+block_k]`` in ``dtype``, zeros past the weight's ends; an fp8 weight's
    values times their scales in float32, rounded to ``dtype`` (the reference's dequantized weight)."""
    n_size, k_size = w.values.shape
    tile = load_tile(w.values.at[pl.ds(n0, block_n), pl.ds(k0, block_k)], n0, k0, n_size=n_size, k_size=k_size,
                     mask_n=n_size % block_n != 0, mask_k=k_size % block_k != 0)
    if w.scales is None:
        return tile.astype(dtype)
    return (tile.astype(jnp.float32) * _row_scales(w, n0, k0, block_n=block_n)).astype(dtype)


def _store_block(y, b_ref, out_ref, n0, *, rows: int):
    """Round ``y`` ([rows_pad, block_n], float32) to the output dtype, add the bias in it (as the
    reference adds it) and store the real rows and columns at ``out[:, n0:]``."""
    rows_pad, block_n = y.shape
    n_size = out_ref.shape[1]
    y = y.astype(out_ref.dtype)
    col = n0 + lax.broadcasted_iota(jnp.int32, (rows_pad, block_n), 1)
    row = lax.broadcasted_iota(jnp.int32, (rows_pad, block_n), 0)
    if b_ref is not None:
        b_col = n0 + jnp.arange(block_n, dtype=jnp.int32)
        b = plgpu.load(b_ref.at[b_col], mask=b_col < b_ref.shape[0], other=0.0).astype(out_ref.dtype)
        y = (y.astype(jnp.float32) + b.astype(jnp.float32)[None, :]).astype(out_ref.dtype)
    plgpu.store(out_ref.at[row, col], y, mask=(row < rows) & (col < n_size))


def _project_block(x_ref, w, b_ref, out_ref, n0, *, rows: int, rows_pad: int, block_n: int, block_k: int,
                   precision):
    k_size = w.values.shape[1]
    mask_k = k_size % block_k != 0
    x_rows = lax.broadcasted_iota(jnp.int32, (rows_pad, block_k), 0)
    x_cols = lax.broadcasted_iota(jnp.int32, (rows_pad, block_k), 1)

    def body(kb, acc):
        k0 = kb * block_k
        w_tile = _weight_block(w, n0, k0, block_n=block_n, block_k=block_k, dtype=x_ref.dtype)
        x_mask = x_rows < rows
        if mask_k:
            x_mask &= (k0 + x_cols) < k_size
        xs = plgpu.load(x_ref.at[x_rows, k0 + x_cols], mask=x_mask, other=0.0).astype(x_ref.dtype)
        if rows_pad == 1:
            return acc + w_tile.astype(jnp.float32) * xs.astype(jnp.float32)
        return acc + plgpu.dot(xs, w_tile, trans_b=True, precision=precision)

    acc_shape = (block_n, block_k) if rows_pad == 1 else (rows_pad, block_n)
    acc = lax.fori_loop(0, pl.cdiv(k_size, block_k), body, jnp.zeros(acc_shape, jnp.float32))
    y = acc.sum(axis=1)[None, :] if rows_pad == 1 else acc
    _store_block(y, b_ref, out_ref, n0, rows=rows)


def _norm_project_block(x_ref, g_ref, w, b_ref, out_ref, n0, *, block_n: int, block_k: int, k_size: int,
                        eps: float, unit_offset: bool):
    """One row: ``rsqrt(mean(x^2) + eps) * (w @ (g * x))`` for this program's weight rows, the sum of
    squares taken from the same loads as the products (see ``norm_project``). ``k_size`` is the real
    row length (the interpreter's operands are padded)."""
    mask_k = k_size % block_k != 0
    cols = lax.broadcasted_iota(jnp.int32, (1, block_k), 1)

    def body(kb, carry):
        acc, squares = carry
        k0 = kb * block_k
        mask = (k0 + cols) < k_size if mask_k else None
        x = (x_ref.at[cols * 0, k0 + cols][...] if mask is None
             else plgpu.load(x_ref.at[cols * 0, k0 + cols], mask=mask, other=0.0)).astype(jnp.float32)
        g_view = g_ref.at[k0 + cols[0]]
        g = (g_view[...] if mask is None else plgpu.load(g_view, mask=mask[0], other=0.0)).astype(jnp.float32)
        scaled = x * ((1.0 + g) if unit_offset else g)[None, :]
        w_tile = _weight_block(w, n0, k0, block_n=block_n, block_k=block_k, dtype=x_ref.dtype)
        return acc + w_tile.astype(jnp.float32) * scaled, squares + x * x

    zeros = (jnp.zeros((block_n, block_k), jnp.float32), jnp.zeros((1, block_k), jnp.float32))
    acc, squares = lax.fori_loop(0, pl.cdiv(w.values.shape[1], block_k), body, zeros)
    inv_rms = lax.rsqrt(squares.sum(axis=1, keepdims=True) / k_size + eps)  # [1, 1]
    _store_block(acc.sum(axis=1)[None, :] * inv_rms, b_ref, out_ref, n0, rows=1)


def _kernel(*refs, num_inputs: int, fp8_blocks: tuple, has_bias: tuple[bool, ...], block_starts: tuple[int, ...],
            block, block_n: int):
    """Inputs ``num_inputs`` row operands (x, or x and the norm weight), the weights (a plain one's
    values; an fp8 one's values and scales: ``fp8_blocks`` says which, False for plain, else its block
    or None), their biases; outputs one array per weight. Each program serves one weight: the one
    whose column blocks hold it."""
    inputs, rest = refs[:num_inputs], refs[num_inputs:]
    n = len(has_bias)
    w_refs = []
    for kind in fp8_blocks:
        w_refs.append(_WeightRefs(rest[0]) if kind is False else _WeightRefs(rest[0], rest[1], kind))
        rest = rest[1 if kind is False else 2:]
    b_refs = []
    for flag in has_bias:
        b_refs.append(rest[0] if flag else None)
        rest = rest[1:] if flag else rest
    out_refs = rest
    p = pl.program_id(0)
    for i in range(n):

        @pl.when((p >= block_starts[i]) & (p < block_starts[i + 1]))
        def _(i=i):
            block(*inputs, w_refs[i], b_refs[i], out_refs[i], (p - block_starts[i]) * block_n)


def _launch(row_inputs, weights, biases, out_rows: int, out_dtype, block, *, blocking: Blocking, interpret: bool,
            name: str):
    """One pallas_call over the column blocks of every weight; ``block(*row_refs, w, b, out, n0)`` fills one."""
    block_n = blocking.block_n
    counts = [pl.cdiv(w.shape[0], block_n) for w in weights]
    block_starts = tuple(int(sum(counts[:i])) for i in range(len(counts) + 1))
    fp8_blocks = tuple(w.block if fp8.is_fp8(w) else False for w in weights)
    weight_operands = [a for w in weights for a in ((w.values, w.scales) if fp8.is_fp8(w) else (w,))]
    inputs = [*row_inputs, *weight_operands, *(b for b in biases if b is not None)]
    kernel = functools.partial(_kernel, num_inputs=len(row_inputs), fp8_blocks=fp8_blocks,
                               has_bias=tuple(b is not None for b in biases), block_starts=block_starts, block=block,
                               block_n=block_n)
    whole = lambda shape: pl.BlockSpec(shape, lambda p: (0,) * len(shape))  # noqa: E731  (indexed in the kernel)
    out_shape = [jax.ShapeDtypeStruct((out_rows, w.shape[0]), out_dtype) for w in weights]
    return pl.pallas_call(
        pdl.with_trigger(kernel, "projection", interpret=interpret),
        grid=(block_starts[-1],),
        in_specs=[whole(a.shape) for a in inputs],
        out_specs=[whole(o.shape) for o in out_shape],
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=blocking.num_warps, num_stages=blocking.num_stages),
        interpret=interpret,
        name=name,
    )(*inputs)


def _operands(rows, weights, biases, block_n: int, block_k: int, interpret: bool):
    """``(rows, weights, biases)`` as the kernel takes them (a bias list with None where a weight has
    none). The interpreter touches masked-off addresses, so there every operand is padded to whole
    blocks: the row operands' last axis to ``block_k``, the weights' rows to ``block_n`` and columns
    to ``block_k``, the biases to ``block_n``."""
    if not interpret:
        return list(rows), list(weights), list(biases)

    def pad_to(a, multiples):
        return jnp.pad(a, [(0, _round_up(n, m) - n) if m else (0, 0) for n, m in zip(a.shape, multiples)])

    def padded_weight(w):
        if not fp8.is_fp8(w):
            return pad_to(w, (block_n, block_k))
        values = pad_to(w.values, (block_n, block_k))
        if w.block is None:
            return type(w)(values, w.scales, None)
        covered = [-(-n // b) for n, b in zip(values.shape, w.block)]  # the scales the padded values index
        scales = jnp.pad(w.scales, [(0, c - s) for c, s in zip(covered, w.scales.shape)], constant_values=1.0)
        return type(w)(values, scales, w.block)

    return ([pad_to(r, (None,) * (r.ndim - 1) + (block_k,)) for r in rows],
            [padded_weight(w) for w in weights],
            [None if b is None else pad_to(b, (block_n,)) for b in biases])


def _checked_rows(x, weights, biases, max_rows: int, what: str):
    weights = tuple(weights)
    biases = (None,) * len(weights) if biases is None else tuple(biases)
    reference.check_projections(x, weights, biases)
    if x.shape[-1] == 0:
        raise ValueError(f"x {x.shape} has no input features to project")
    x2 = x.reshape(-1, x.shape[-1])
    if not 0 < x2.shape[0] <= max_rows:
        raise ValueError(f"{what}, not {x2.shape[0]} (x {x.shape})")
    return x2, weights, biases


def _unpadded(outputs, x, weights):
    rows, lead = x.size // x.shape[-1], x.shape[:-1]
    return tuple(o[:rows, :w.shape[0]].reshape(*lead, w.shape[0]) for o, w in zip(outputs, weights))


@functools.partial(jax.jit, static_argnames=("blocking", "interpret"))
def project(x, weights, biases=None, *, blocking: Blocking | None = None, interpret: bool = False):
    """``reference.project`` for x with at most ``MAX_ROWS`` rows (leading axes flattened), every
    weight in one launch. ``blocking`` overrides ``default_blocking`` (narrowed for fp8 blocks:
    ``aligned_blocking``)."""
    x2, weights, biases = _checked_rows(x, weights, biases, MAX_ROWS,
                                       f"the few-row projection kernel takes 1 to {MAX_ROWS} rows")
    rows, k_size = x2.shape
    blocking = (_check_aligned(blocking, weights) if blocking
                else aligned_blocking(default_blocking(rows, k_size), weights))
    block_n, block_k = blocking.block_n, blocking.block_k
    rows_pad = 1 if rows == 1 else max(16, _next_pow2(rows))
    if rows_pad > 1 and block_n < 16:
        raise ValueError(f"block_n ({block_n}) must be >= 16 for more than one row (tensor-core dot)")
    out_rows = rows_pad if interpret else rows  # the interpreter also writes the padding rows
    x_in = jnp.pad(x2, ((0, rows_pad - rows), (0, 0))) if interpret else x2
    (x_in,), w_in, b_in = _operands([x_in], weights, biases, block_n, block_k, interpret)
    precision = lax.Precision.HIGHEST if jnp.dtype(x.dtype) == jnp.float32 else None
    block = functools.partial(_project_block, rows=rows, rows_pad=rows_pad, block_n=block_n, block_k=block_k,
                              precision=precision)
    outputs = _launch([x_in], w_in, b_in, out_rows, x.dtype, block, blocking=blocking, interpret=interpret,
                      name=f"project_{block_n=}_{block_k=}")
    return _unpadded(outputs, x, weights)


@functools.partial(jax.jit, static_argnames=("eps", "unit_offset", "blocking", "interpret"))
def norm_project(x, norm_weight, weights, biases=None, *, eps: float, unit_offset: bool = False,
                 blocking: Blocking | None = None, interpret: bool = False):
    """The projections of ``reference.norm_project(x, None, ...)`` for one row (the residual already
    added), in one launch, without waiting for the norm.

    RMSNorm scales the row by one number, so ``w @ (g * x * r) = r * (w @ (g * x))``: each program
    streams its weight rows against ``g * x`` at once, sums ``x^2`` from the same loads (every program
    walks the whole row) and scales its outputs by ``r = rsqrt(mean(x^2) + eps)`` at the end. The
    normalised row is never rounded to ``x``'s dtype, as the reference rounds it (and so is closer to
    the float32 result). ``unit_offset`` multiplies by ``1 + g``; ``float32_weight`` makes no
    difference here (every product is in float32).
    """
    x2, weights, biases = _checked_rows(x, weights, biases, 1, "norm_project's kernel takes one row (more rows run "
                                       "the add + norm kernel, then project)")
    k_size = x2.shape[1]
    if norm_weight.shape != (k_size,):
        raise ValueError(f"norm weight {norm_weight.shape} must be [{k_size}] for x {x.shape}")
    blocking = (_check_aligned(blocking, weights) if blocking
                else aligned_blocking(default_norm_blocking(k_size), weights))
    block_n, block_k = blocking.block_n, blocking.block_k
    row_in, w_in, b_in = _operands([x2, norm_weight], weights, biases, block_n, block_k, interpret)
    block = functools.partial(_norm_project_block, block_n=block_n, block_k=block_k, k_size=k_size, eps=float(eps),
                              unit_offset=unit_offset)
    outputs = _launch(row_in, w_in, b_in, 1, x.dtype, block, blocking=blocking, interpret=interpret,
                      name=f"norm_project_{block_n=}_{block_k=}")
    return _unpadded(outputs, x, weights)


__all__ = ["Blocking", "MAX_ROWS", "MIN_BLOCK_K", "aligned_blocking", "default_blocking", "default_norm_blocking",
           "norm_project", "project", "takes_weights"]
