"""One decode token of the gated delta rule per sequence, over the slot pool, in Pallas (Triton lowering).

Same contract as ``reference.recurrent_update``; the gate is ``g [S, H]`` (one decay per head) or
``g [S, H, Dk]`` (one per key channel, as KDA), a static switch on g's rank. Grid ``(sequence,
head, Dv block)``: a program reads its ``[Dk, block_v]`` slice of the state at the sequence's slot
(``state_pool [N, H, Dk, Dv]``, aliased to the output pool: in place where the caller's program
donates it), decays it, takes the delta ``beta (v - S^T k)``, adds ``k delta^T``, writes the output
``S^T q`` and the state back. Decode is memory-bound: each program streams its state slice once in
and once out, with no matmul (the products are reductions over Dk), so ``block_v`` is chosen for a
tile of about ``TILE`` floats with full 128-byte rows. A slot of -1 (a padding row) reads and writes
nothing and outputs zeros; a slot past the pool reads its last state and writes nothing, as the
reference. Slots must be distinct (programs of two rows at one slot would race on it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_DIM, MAX_DIM = 16, 256  # key and value head dims: powers of two in this range
# State elements per program (block_v = TILE / Dk): docs/performance.md, "Gated delta rule kernels".
TILE = 8192
_TUNING = ("block_v",)
_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _dim_ok(n: int) -> bool:
    return _is_pow2(n) and MIN_DIM <= n <= MAX_DIM


def default_block_v(key_dim: int, value_dim: int) -> int:
    """``TILE // Dk`` columns of Dv (at least 32: 128-byte float32 rows), at most Dv."""
    return min(value_dim, max(32, TILE // key_dim))


def _unsupported_reason(state_pool, slots, q, k, v, g, beta, options) -> str | None:
    unknown = sorted(set(options) - set(_TUNING))
    if unknown:
        return f"unknown options {unknown}"
    if state_pool.ndim != 4:
        return f"state_pool must be [N, H, Dk, Dv], not {state_pool.shape}"
    _, num_heads, key_dim, value_dim = state_pool.shape
    if slots.ndim != 1 or not jnp.issubdtype(slots.dtype, jnp.integer):
        return f"slots must be integer [S], not {slots.dtype}{slots.shape}"
    num_seqs = slots.shape[0]
    if num_seqs == 0:
        return "no sequences"
    if q.shape != (num_seqs, num_heads, key_dim) or k.shape != q.shape or v.shape != (num_seqs, num_heads, value_dim):
        return f"q, k must be [S, H, Dk] and v [S, H, Dv] of the pool's dims, not {q.shape}, {k.shape}, {v.shape}"
    if not (_dim_ok(key_dim) and _dim_ok(value_dim)):
        return f"Dk ({key_dim}) and Dv ({value_dim}) must be powers of two from {MIN_DIM} to {MAX_DIM}"
    if g.shape not in ((num_seqs, num_heads), (num_seqs, num_heads, key_dim)):
        return f"g must be [S, H] or [S, H, Dk], not {g.shape}"
    if beta.shape != (num_seqs, num_heads):
        return f"beta must be [S, H], not {beta.shape}"
    if any(jnp.dtype(x.dtype) not in _FLOATS for x in (state_pool, q, k, v, g, beta)):
        return "the pool, q, k, v, g and beta must be float32, bfloat16 or float16"
    block = options.get("block_v")
    if block is not None and not (_is_pow2(block) and block <= value_dim):
        return f"block_v ({block}) must be a power of two up to Dv ({value_dim})"
    return None


def supports(state_pool, slots, q, k, v, g, beta, **options) -> bool:
    """Whether the kernel takes the call: a pool ``[N, H, Dk, Dv]`` with Dk and Dv powers of two
    from 16 to 256, integer slots ``[S]`` (S >= 1), q, k ``[S, H, Dk]``, v ``[S, H, Dv]``, g ``[S,
    H]`` or ``[S, H, Dk]``, beta ``[S, H]``, float dtypes; only the tuning option ``block_v`` (a
    power of two up to Dv)."""
    return _unsupported_reason(state_pool, slots, q, k, v, g, beta, options) is None


def _kernel(slots_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_in_ref, out_ref, pool_ref, *, num_slots: int):
    s, h = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[s]

    @pl.when(slot >= 0)
    def _():
        f32 = jnp.float32
        state = pool_in_ref[jnp.minimum(slot, num_slots - 1)].astype(f32)  # [Dk, block_v]
        if len(g_ref.shape) == 1:  # one decay per key channel: this row's [Dk]
            state = state * jnp.exp(g_ref[...].astype(f32))[:, None]
        else:
            state = state * jnp.exp(g_ref[s, h].astype(f32))
        k = k_ref[...].astype(f32)
        delta = beta_ref[s, h].astype(f32) * (v_ref[...].astype(f32) - jnp.sum(state * k[:, None], axis=0))
        state = state + k[:, None] * delta[None, :]
        out_ref[...] = jnp.sum(state * q_ref[...].astype(f32)[:, None], axis=0)

        @pl.when(slot < num_slots)
        def _():
            pool_ref[slot] = state.astype(pool_ref.dtype)

    @pl.when(slot < 0)
    def _():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",) + _TUNING)
def recurrent_update(state_pool, slots, q, k, v, g, beta, *, interpret: bool = False, block_v=None):
    """state_pool [N, H, Dk, Dv] (updated in place), slots [S] (-1: padding), q, k [S, H, Dk], v
    [S, H, Dv], g [S, H] or [S, H, Dk], beta [S, H] -> (outputs [S, H, Dv] float32, the pool); see
    ``reference.recurrent_update``. ``block_v``: ``default_block_v`` where absent. A call
    ``supports`` refuses raises ValueError."""
    options = {} if block_v is None else {"block_v": block_v}
    reason = _unsupported_reason(state_pool, slots, q, k, v, g, beta, options)
    if reason is not None:
        raise ValueError(f"recurrent_update kernel: {reason}")
    num_slots, num_heads, key_dim, value_dim = state_pool.shape
    num_seqs = slots.shape[0]
    block_v = block_v or default_block_v(key_dim, value_dim)
    per_channel = g.ndim == 3
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    row = lambda width, blocked=False: pl.BlockSpec(  # noqa: E731
        (None, None, width), (lambda s, h, b: (s, h, b)) if blocked else (lambda s, h, b: (s, h, 0)))
    pool_spec = pl.BlockSpec((num_slots, None, key_dim, block_v), lambda s, h, b: (0, h, 0, b))
    slots = slots.astype(jnp.int32)
    out, pool = pl.pallas_call(
        functools.partial(_kernel, num_slots=num_slots),
        grid=(num_seqs, num_heads, value_dim // block_v),
        in_specs=[whole(slots), row(key_dim), row(key_dim), row(block_v, True),
                  row(key_dim) if per_channel else whole(g), whole(beta), pool_spec],
        out_specs=[row(block_v, True), pool_spec],
        out_shape=[jax.ShapeDtypeStruct((num_seqs, num_heads, value_dim), jnp.float32),
                   jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype)],
        input_output_aliases={6: 1},
        compiler_params=plgpu.CompilerParams(num_warps=max(1, min(4, key_dim * block_v // 1024)), num_stages=1),
        interpret=interpret,
        name="gated_delta_recurrent_update",
    )(slots, q, k, v, g, beta, state_pool)
    return out, pool


__all__ = ["default_block_v", "recurrent_update", "supports"]
