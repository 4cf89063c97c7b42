"""The two ways a per-head recurrence (gated delta rule, KDA, lightning attention) runs over a step,
given its one-token ``step(state, *token_inputs, *shared) -> (output, state)``; the linear-attention
references are these with their own step.

``scan_packed``: token by token over packed sequences (``cu_seqlens``), each starting from its
initial state; rows past ``cu_seqlens[-1]`` are padding (zero output, no state touched), and a
sequence with no rows keeps its initial state. ``update_slots``: one token per sequence, the state
read from and written back to a slot pool (slot -1: a padding row, nothing read or written, zero
output). Everything in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _f32(x):
    return x.astype(jnp.float32)


def scan_packed(step, token_inputs, cu_seqlens, initial_state, shared=()):
    """``token_inputs``: arrays [T, ...]; ``shared``: arrays every token reads (a per-head slope)
    -> (outputs [T, ...] float32, final states [S, ...] float32)."""
    num_tokens = token_inputs[0].shape[0]
    rows = jnp.arange(num_tokens)
    seq = jnp.searchsorted(cu_seqlens[1:], rows, side="right")  # the sequence of each row
    valid = rows < cu_seqlens[-1]
    first = valid & (rows == cu_seqlens[jnp.minimum(seq, cu_seqlens.shape[0] - 2)])
    shared = tuple(map(_f32, shared))

    def one_token(carry, xs):
        state, finals = carry
        *inputs, s, is_valid, is_first = xs
        s = jnp.minimum(s, finals.shape[0] - 1)
        state = jnp.where(is_first, finals[s], state)  # a sequence starts from its initial state
        out, new_state = step(state, *inputs, *shared)
        state = jnp.where(is_valid, new_state, state)
        finals = jnp.where(is_valid, finals.at[s].set(state), finals)
        return (state, finals), jnp.where(is_valid, out, 0.0)

    init = (jnp.zeros(initial_state.shape[1:], jnp.float32), _f32(initial_state))
    (_, finals), outputs = jax.lax.scan(one_token, init, (*map(_f32, token_inputs), seq, valid, first))
    return outputs, finals


def update_slots(step, state_pool, slots, row_inputs, shared=()):
    """``row_inputs``: arrays [S, ...], one row per sequence -> (outputs [S, ...] float32, the pool)."""
    states = _f32(state_pool[jnp.maximum(slots, 0)])
    in_axes = (0,) * (1 + len(row_inputs)) + (None,) * len(shared)
    out, states = jax.vmap(step, in_axes=in_axes)(states, *map(_f32, row_inputs), *map(_f32, shared))
    keep = slots >= 0
    target = jnp.where(keep, slots, state_pool.shape[0])  # out of range: dropped
    state_pool = state_pool.at[target].set(states.astype(state_pool.dtype), mode="drop")
    return jnp.where(keep.reshape(-1, *([1] * (out.ndim - 1))), out, 0.0), state_pool


__all__ = ["scan_packed", "update_slots"]
