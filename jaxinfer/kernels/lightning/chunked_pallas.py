"""Lightning attention prefill in Pallas (Triton lowering): one program per (sequence, head, value
block) walks its sequence's chunks with the state in registers.

``reference.lightning_attention`` over packed sequences (``cu_seqlens``). Grid ``(S, H, Dv /
block_v)``: the recurrence is independent per value column, so a program carries the ``[Dk,
block_v]`` float32 state of one head of one sequence through ``cdiv(len, chunk)`` chunks (a loop
with a dynamic trip count; an empty sequence copies its initial state). Per chunk of ``n`` rows
(rows gathered straight from the ``[T, H, D]`` inputs, masked past the sequence's end):

    O  = (q k^T * D) v + (q D_q) S        S' = exp(-s n) S + (k D_k)^T v

with the decays of ``chunked.py`` made in the kernel from the head's slope (exponents never
positive: no overflow). Four matmuls per chunk in float32, as three tf32 tensor-core passes each
(float32 accuracy: one tf32 pass would round the state); bf16/f16 inputs are widened after the
load. Outputs go straight into their rows of ``[T, H, Dv]``; padding rows keep the zeros of the
aliased output.

Tiles: ``chunk`` 64 as the jnp form up to Dk 64, 32 beyond, ``block_v`` the whole value dim up to
64, 4 warps, or 8 when the state tile holds more than 4096 floats (registers: the state, the q/k
tiles and the ``[chunk, chunk]`` scores live together); docs/performance.md, "Lightning attention
kernels", has the runs behind them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.kernels.lightning.chunked import CHUNK

_TUNING = ("chunk", "block_v", "num_warps", "num_stages")
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Three tf32 tensor-core passes: float32 accuracy, at a fraction of IEEE products' time (one tf32
# pass would round the state). The interpreter keeps IEEE (HIGHEST).
_GPU_PRECISION = lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _pow2(n) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def plan(dk: int, dv: int, *, chunk=None, block_v=None, num_warps=None, num_stages=None) -> dict:
    """The tiles for head dims ``dk``/``dv`` (see the module docstring); given options win."""
    block_v = block_v or min(dv, 64)
    return dict(chunk=chunk or (CHUNK if dk <= 64 else CHUNK // 2), block_v=block_v,
                num_warps=num_warps or (4 if dk * block_v <= 4096 else 8), num_stages=num_stages or 2)


def _unsupported_reason(q, k, v, slope, cu_seqlens, initial_state, options) -> str | None:
    unknown = sorted(set(options) - set(_TUNING))
    if unknown:
        return f"unknown options {unknown}"
    if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or v.shape[:2] != q.shape[:2]:
        return f"q, k [T, H, Dk] and v [T, H, Dv] expected, not {q.shape}, {k.shape}, {v.shape}"
    if not all(x.dtype == q.dtype for x in (k, v)) or jnp.dtype(q.dtype) not in map(jnp.dtype, _DTYPES):
        return f"q, k, v must share one of float32/bfloat16/float16, not {q.dtype}, {k.dtype}, {v.dtype}"
    _, heads, dk = q.shape
    dv = v.shape[-1]
    if slope.shape != (heads,):
        return f"slope must be [H={heads}], not {slope.shape}"
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2 or not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        return f"cu_seqlens must be integer [S + 1], not {cu_seqlens.dtype}{cu_seqlens.shape}"
    if initial_state.shape != (cu_seqlens.shape[0] - 1, heads, dk, dv):
        return f"initial_state must be [S, H, Dk, Dv], not {initial_state.shape}"
    tiles = plan(dk, dv, **options)
    if not (_pow2(dk) and 16 <= dk <= 256 and _pow2(dv) and 16 <= dv <= 256):
        return f"head dims must be powers of two in [16, 256], not Dk={dk}, Dv={dv}"
    if not (_pow2(tiles["chunk"]) and 16 <= tiles["chunk"] <= 128):
        return f"chunk must be a power of two in [16, 128], not {tiles['chunk']}"
    if not (_pow2(tiles["block_v"]) and 16 <= tiles["block_v"] and dv % tiles["block_v"] == 0):
        return f"block_v must be a power of two >= 16 dividing Dv={dv}, not {tiles['block_v']}"
    return None


def supports(q, k, v, slope, cu_seqlens, initial_state, **options) -> bool:
    """Whether the kernel takes the call: q/k/v of one float dtype, head dims powers of two in
    [16, 256], slope [H], an initial state per sequence, known tiles that fit the dims."""
    return _unsupported_reason(q, k, v, slope, cu_seqlens, initial_state, options) is None


def _kernel(bounds_ref, slope_ref, q_ref, k_ref, v_ref, state_ref, _, out_ref, final_ref, *, chunk: int,
            dump_row: int, precision):
    start, end = bounds_ref[0], bounds_ref[1]
    slope = slope_ref[0]
    dk, block_v = q_ref.shape[-1], state_ref.shape[-1]
    dot = functools.partial(plgpu.dot, precision=precision)
    i = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    j = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    within = jnp.where(i >= j, jnp.exp(-slope * jnp.maximum(i - j, 0).astype(jnp.float32)), 0.0)
    offsets = lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    to_query = jnp.exp(-slope * (offsets + 1).astype(jnp.float32))
    k_columns = lax.broadcasted_iota(jnp.int32, (1, dk), 1)
    # v and the output are passed whole ([T, Dv] of the head): the program's value columns are
    # explicit, a gather on a block narrower than the array is not offset by Triton's lowering.
    v_columns = pl.program_id(2) * block_v + lax.broadcasted_iota(jnp.int32, (1, block_v), 1)

    def body(c, state):
        first = start + c * chunk
        n = jnp.minimum(end - first, chunk)
        inside = offsets < n
        rows = jnp.where(inside, first + offsets, 0)[:, None]
        load = lambda ref, columns: plgpu.load(ref.at[rows, columns], mask=inside[:, None],  # noqa: E731
                                               other=0.0).astype(jnp.float32)
        q, k, v = load(q_ref, k_columns), load(k_ref, k_columns), load(v_ref, v_columns)
        out = dot(dot(q, k, trans_b=True) * within, v) + dot(q * to_query[:, None], state)
        to_end = jnp.where(inside, jnp.exp(-slope * jnp.maximum(n - 1 - offsets, 0).astype(jnp.float32)), 0.0)
        state = state * jnp.exp(-slope * n.astype(jnp.float32)) + dot(k * to_end[:, None], v, trans_a=True)
        out_rows = jnp.where(inside, first + offsets, dump_row)[:, None]
        plgpu.store(out_ref.at[out_rows, v_columns], out, mask=inside[:, None])
        return state

    num_chunks = (end - start + chunk - 1) // chunk
    final_ref[...] = lax.fori_loop(0, num_chunks, body, state_ref[...].astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("interpret",) + _TUNING)
def lightning_attention(q, k, v, slope, cu_seqlens, initial_state, *, interpret=False, **tuning):
    """q, k [T, H, Dk], v [T, H, Dv] (one float dtype), slope [H], cu_seqlens [S + 1] int,
    initial_state [S, H, Dk, Dv] -> (outputs [T, H, Dv] float32, final states [S, H, Dk, Dv]
    float32). ``tuning``: ``chunk``, ``block_v``, ``num_warps``, ``num_stages`` (``plan``'s where
    absent). A call ``supports`` refuses raises ValueError."""
    reason = _unsupported_reason(q, k, v, slope, cu_seqlens, initial_state, tuning)
    if reason is not None:
        raise ValueError(f"lightning_attention kernel: {reason}")
    num_tokens, heads, dk = q.shape
    dv = v.shape[-1]
    num_seqs = cu_seqlens.shape[0] - 1
    tiles = plan(dk, dv, **tuning)
    block_v = tiles["block_v"]
    cu_seqlens = cu_seqlens.astype(jnp.int32)
    bounds = jnp.stack([cu_seqlens[:-1], cu_seqlens[1:]], axis=1)  # [S, 2]: each sequence's rows
    # Masked-off rows point at row 0: the GPU writes nothing there. Pallas's interpreter turns a
    # masked scatter into read-modify-write, so there they point at one extra row, dropped after.
    out_rows = num_tokens + (1 if interpret else 0)
    rows_spec = lambda rows, width: pl.BlockSpec((rows, None, width), lambda s, h, b: (0, h, 0))  # noqa: E731
    state_spec = pl.BlockSpec((None, None, dk, block_v), lambda s, h, b: (s, h, 0, b))
    out, finals = pl.pallas_call(
        functools.partial(_kernel, chunk=tiles["chunk"], dump_row=num_tokens if interpret else 0,
                          precision=lax.Precision.HIGHEST if interpret else _GPU_PRECISION),
        grid=(num_seqs, heads, dv // block_v),
        in_specs=[pl.BlockSpec((None, 2), lambda s, h, b: (s, 0)),
                  pl.BlockSpec((1,), lambda s, h, b: (h,)),
                  rows_spec(num_tokens, dk), rows_spec(num_tokens, dk), rows_spec(num_tokens, dv), state_spec,
                  rows_spec(out_rows, dv)],
        out_specs=[rows_spec(out_rows, dv), state_spec],
        out_shape=[jax.ShapeDtypeStruct((out_rows, heads, dv), jnp.float32),
                   jax.ShapeDtypeStruct((num_seqs, heads, dk, dv), jnp.float32)],
        input_output_aliases={6: 0},  # padding rows keep their zeros
        compiler_params=plgpu.CompilerParams(num_warps=tiles["num_warps"], num_stages=tiles["num_stages"]),
        interpret=interpret,
        name="lightning_prefill",
    )(bounds, slope.astype(jnp.float32), q, k, v, initial_state.astype(jnp.float32),
      jnp.zeros((out_rows, heads, dv), jnp.float32))
    return out[:num_tokens], finals


__all__ = ["lightning_attention", "plan", "supports"]
