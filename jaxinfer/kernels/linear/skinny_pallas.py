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
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.kernels.linear import reference

MAX_ROWS = 16  # the most rows of x the kernel takes (the dispatcher uses it at one row: see __init__.py)


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
    contiguous reads); more rows: 16 by 256, the tensor-core tile. 4 warps, 3 stages.

    Measured by ``scripts/linear_check.py --sweep`` on the H200 with the weights read from HBM: at
    one row, 4 x 1024 was within 4% of the best of 2-16 rows by 512-2048 columns at each of the
    Qwen3-30B-A3B q/k/v, Llama-3-8B gate/up and GPT-OSS-20B q/k/v shapes, while 16-row blocks were
    up to 25% slower.
    """
    if rows == 1:
        return Blocking(4, min(1024, max(16, _next_pow2(in_features))), num_warps=4, num_stages=3)
    return Blocking(16, min(256, max(16, _next_pow2(in_features))), num_warps=4, num_stages=3)


def _project_block(x_ref, w_ref, b_ref, out_ref, n0, *, rows: int, rows_pad: int, block_n: int, block_k: int,
                   precision):
    n_size, k_size = w_ref.shape
    mask_n, mask_k = n_size % block_n != 0, k_size % block_k != 0
    n_idx = n0 + lax.broadcasted_iota(jnp.int32, (block_n, block_k), 0)
    k_iota = lax.broadcasted_iota(jnp.int32, (block_n, block_k), 1)
    x_rows = lax.broadcasted_iota(jnp.int32, (rows_pad, block_k), 0)
    x_cols = lax.broadcasted_iota(jnp.int32, (rows_pad, block_k), 1)

    def body(kb, acc):
        k0 = kb * block_k
        w_view = w_ref.at[pl.ds(n0, block_n), pl.ds(k0, block_k)]
        if mask_n or mask_k:
            w_mask = jnp.ones((block_n, block_k), jnp.bool_)
            if mask_n:
                w_mask &= n_idx < n_size
            if mask_k:
                w_mask &= (k0 + k_iota) < k_size
            w = plgpu.load(w_view, mask=w_mask, other=0.0)
        else:
            w = w_view[...]
        x_mask = x_rows < rows
        if mask_k:
            x_mask &= (k0 + x_cols) < k_size
        xs = plgpu.load(x_ref.at[x_rows, k0 + x_cols], mask=x_mask, other=0.0).astype(x_ref.dtype)
        w = w.astype(x_ref.dtype)
        if rows_pad == 1:
            return acc + w.astype(jnp.float32) * xs.astype(jnp.float32)
        return acc + plgpu.dot(xs, w, trans_b=True, precision=precision)

    acc_shape = (block_n, block_k) if rows_pad == 1 else (rows_pad, block_n)
    acc = lax.fori_loop(0, pl.cdiv(k_size, block_k), body, jnp.zeros(acc_shape, jnp.float32))
    y = acc.sum(axis=1)[None, :] if rows_pad == 1 else acc
    y = y.astype(out_ref.dtype)
    col = n0 + lax.broadcasted_iota(jnp.int32, (rows_pad, block_n), 1)
    row = lax.broadcasted_iota(jnp.int32, (rows_pad, block_n), 0)
    col_ok = col < n_size
    if b_ref is not None:  # added in the output dtype, as the reference adds it
        b_col = n0 + jnp.arange(block_n, dtype=jnp.int32)
        b = plgpu.load(b_ref.at[b_col], mask=b_col < n_size, other=0.0).astype(out_ref.dtype)
        y = (y.astype(jnp.float32) + b.astype(jnp.float32)[None, :]).astype(out_ref.dtype)
    plgpu.store(out_ref.at[row, col], y, mask=(row < rows) & col_ok)


def _kernel(x_ref, *refs, has_bias: tuple[bool, ...], block_starts: tuple[int, ...], **options):
    n = len(has_bias)
    w_refs, rest = refs[:n], refs[n:]
    b_refs = []
    for flag in has_bias:
        b_refs.append(rest[0] if flag else None)
        rest = rest[1:] if flag else rest
    out_refs = rest
    block_n = options["block_n"]
    p = pl.program_id(0)
    for i in range(n):  # each program serves one weight: the one whose column blocks hold p

        @pl.when((p >= block_starts[i]) & (p < block_starts[i + 1]))
        def _(i=i):
            _project_block(x_ref, w_refs[i], b_refs[i], out_refs[i], (p - block_starts[i]) * block_n, **options)


@functools.partial(jax.jit, static_argnames=("blocking", "interpret"))
def project(x, weights, biases=None, *, blocking: Blocking | None = None, interpret: bool = False):
    """``reference.project`` for x with at most ``MAX_ROWS`` rows (leading axes flattened), every
    weight in one launch. ``blocking`` overrides ``default_blocking``."""
    weights = tuple(weights)
    biases = (None,) * len(weights) if biases is None else tuple(biases)
    reference.check_projections(x, weights, biases)
    lead, k_size = x.shape[:-1], x.shape[-1]
    if k_size == 0:
        raise ValueError(f"x {x.shape} has no input features to project")
    x2 = x.reshape(-1, k_size)
    rows = x2.shape[0]
    if not 0 < rows <= MAX_ROWS:
        raise ValueError(f"the few-row projection kernel takes 1 to {MAX_ROWS} rows, not {rows} (x {x.shape})")
    out_features = tuple(w.shape[0] for w in weights)
    blocking = blocking or default_blocking(rows, k_size)
    block_n, block_k = blocking.block_n, blocking.block_k
    rows_pad = 1 if rows == 1 else max(16, _next_pow2(rows))
    if rows_pad > 1 and block_n < 16:
        raise ValueError(f"block_n ({block_n}) must be >= 16 for more than one row (tensor-core dot)")
    counts = [pl.cdiv(n, block_n) for n in out_features]
    block_starts = tuple(int(sum(counts[:i])) for i in range(len(counts) + 1))
    inputs = [x2, *weights, *(b for b in biases if b is not None)]
    out_rows, out_cols = rows, list(out_features)
    if interpret:  # the interpreter touches masked-off addresses: give them memory
        k_pad = _round_up(k_size, block_k)
        x_in = jnp.pad(x2, ((0, rows_pad - rows), (0, k_pad - k_size)))
        w_in = [jnp.pad(w, ((0, _round_up(n, block_n) - n), (0, k_pad - k_size))) for w, n in zip(weights, out_features)]
        b_in = [jnp.pad(b, (0, _round_up(b.shape[0], block_n) - b.shape[0])) for b in biases if b is not None]
        inputs = [x_in, *w_in, *b_in]
        out_rows, out_cols = rows_pad, [_round_up(n, block_n) for n in out_features]
    precision = lax.Precision.HIGHEST if jnp.dtype(x.dtype) == jnp.float32 else None
    kernel = functools.partial(_kernel, has_bias=tuple(b is not None for b in biases), block_starts=block_starts,
                               rows=rows, rows_pad=rows_pad, block_n=block_n, block_k=block_k, precision=precision)
    whole = lambda shape: pl.BlockSpec(shape, lambda p: (0,) * len(shape))  # noqa: E731  (indexed in the kernel)
    out_shape = [jax.ShapeDtypeStruct((out_rows, n), x.dtype) for n in out_cols]
    outputs = pl.pallas_call(
        kernel,
        grid=(block_starts[-1],),
        in_specs=[whole(a.shape) for a in inputs],
        out_specs=[whole(o.shape) for o in out_shape],
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=blocking.num_warps, num_stages=blocking.num_stages),
        interpret=interpret,
        name=f"project_{block_n=}_{block_k=}",
    )(*inputs)
    return tuple(o[:rows, :n].reshape(*lead, n) for o, n in zip(outputs, out_features))


__all__ = ["Blocking", "MAX_ROWS", "default_blocking", "project"]
