"""Lightning attention decode in Pallas (Triton lowering): one token per sequence, its state read
from and written back to a slot pool in place.

``reference.recurrent_update``. Grid ``(S, H, Dv / block_v)``: a program reads the ``[Dk,
block_v]`` float32 state of one head of the row's slot, applies ``S = exp(-s) S + k^T v`` and
``o = q S`` (elementwise and a column sum: no matmul at one token), and writes the state back. The
pool is aliased to the output, so only the step's slots are written (a donated pool is updated
in place); a padding row (slot -1) reads slot 0's tile, writes nothing and outputs zeros. Slots
other than -1 must be distinct within a call (the engine's are).

Tiles: ``block_v`` the whole value dim up to 64 (a 128 x 64 float32 tile is 64 registers per
thread over 4 warps), 4 warps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_TUNING = ("block_v", "num_warps")
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _pow2(n) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def plan(dk: int, dv: int, *, block_v=None, num_warps=None) -> dict:
    """The tiles for head dims ``dk``/``dv`` (see the module docstring); given options win."""
    return dict(block_v=block_v or min(dv, 64), num_warps=num_warps or 4)


def _unsupported_reason(state_pool, slots, q, k, v, slope, options) -> str | None:
    unknown = sorted(set(options) - set(_TUNING))
    if unknown:
        return f"unknown options {unknown}"
    if state_pool.ndim != 4 or state_pool.dtype != jnp.float32:
        return f"state_pool must be float32 [N, H, Dk, Dv], not {state_pool.dtype}{state_pool.shape}"
    _, heads, dk, dv = state_pool.shape
    rows = slots.shape[0] if slots.ndim == 1 else -1
    if rows < 0 or not jnp.issubdtype(slots.dtype, jnp.integer):
        return f"slots must be integer [S], not {slots.dtype}{slots.shape}"
    if q.shape != (rows, heads, dk) or k.shape != q.shape or v.shape != (rows, heads, dv):
        return f"q, k [S, H, Dk] and v [S, H, Dv] of the pool's dims expected, not {q.shape}, {k.shape}, {v.shape}"
    if not all(x.dtype == q.dtype for x in (k, v)) or jnp.dtype(q.dtype) not in map(jnp.dtype, _DTYPES):
        return f"q, k, v must share one of float32/bfloat16/float16, not {q.dtype}, {k.dtype}, {v.dtype}"
    if slope.shape != (heads,):
        return f"slope must be [H={heads}], not {slope.shape}"
    if not (_pow2(dk) and dk <= 256 and _pow2(dv) and dv <= 256):
        return f"head dims must be powers of two up to 256, not Dk={dk}, Dv={dv}"
    block_v = plan(dk, dv, **options)["block_v"]
    if not (_pow2(block_v) and dv % block_v == 0):
        return f"block_v must be a power of two dividing Dv={dv}, not {block_v}"
    return None


def supports(state_pool, slots, q, k, v, slope, **options) -> bool:
    """Whether the kernel takes the call: a float32 pool, an integer slot per row, q/k/v of one
    float dtype with the pool's head dims (powers of two up to 256), slope [H], known tiles."""
    return _unsupported_reason(state_pool, slots, q, k, v, slope, options) is None


def _kernel(slot_ref, slope_ref, q_ref, k_ref, v_ref, pool_ref, out_ref, new_pool_ref):
    slot = slot_ref[0]
    q, k, v = (ref[...].astype(jnp.float32) for ref in (q_ref, k_ref, v_ref))
    state = pool_ref[jnp.maximum(slot, 0)] * jnp.exp(-slope_ref[0]) + k[:, None] * v[None, :]
    out_ref[...] = jnp.where(slot >= 0, jnp.sum(q[:, None] * state, axis=0), 0.0)

    @pl.when(slot >= 0)
    def _write():
        new_pool_ref[slot] = state


@functools.partial(jax.jit, static_argnames=("interpret",) + _TUNING)
def recurrent_update(state_pool, slots, q, k, v, slope, *, interpret=False, **tuning):
    """state_pool [N, H, Dk, Dv] float32, slots [S] int (-1: padding), q/k [S, H, Dk], v [S, H, Dv],
    slope [H] -> (outputs [S, H, Dv] float32, the pool with the slots' states advanced).
    ``tuning``: ``block_v``, ``num_warps`` (``plan``'s where absent). A call ``supports`` refuses
    raises ValueError."""
    reason = _unsupported_reason(state_pool, slots, q, k, v, slope, tuning)
    if reason is not None:
        raise ValueError(f"lightning recurrent_update kernel: {reason}")
    num_slots, heads, dk, dv = state_pool.shape
    rows = slots.shape[0]
    tiles = plan(dk, dv, **tuning)
    block_v = tiles["block_v"]
    pool_spec = pl.BlockSpec((num_slots, None, dk, block_v), lambda s, h, b: (0, h, 0, b))
    return pl.pallas_call(
        _kernel,
        grid=(rows, heads, dv // block_v),
        in_specs=[pl.BlockSpec((1,), lambda s, h, b: (s,)),
                  pl.BlockSpec((1,), lambda s, h, b: (h,)),
                  pl.BlockSpec((None, None, dk), lambda s, h, b: (s, h, 0)),
                  pl.BlockSpec((None, None, dk), lambda s, h, b: (s, h, 0)),
                  pl.BlockSpec((None, None, block_v), lambda s, h, b: (s, h, b)),
                  pool_spec],
        out_specs=[pl.BlockSpec((None, None, block_v), lambda s, h, b: (s, h, b)), pool_spec],
        out_shape=[jax.ShapeDtypeStruct((rows, heads, dv), jnp.float32),
                   jax.ShapeDtypeStruct(state_pool.shape, jnp.float32)],
        input_output_aliases={5: 1},
        compiler_params=plgpu.CompilerParams(num_warps=tiles["num_warps"], num_stages=1),
        interpret=interpret,
        name="lightning_decode",
    )(slots.astype(jnp.int32), slope.astype(jnp.float32), q, k, v, state_pool)


__all__ = ["plan", "recurrent_update", "supports"]
