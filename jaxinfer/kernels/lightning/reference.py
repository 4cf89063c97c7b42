"""Lightning attention (MiniMax-Text-01's linear attention) token by token: the semantic truth.

Per head ``h``, a state ``S [Dk, Dv]`` (float32) evolves with each token ``t`` of a sequence:

    S = exp(-slope_h) * S + k_t^T v_t   (a constant decay per head, then the token's write)
    o_t = q_t S                         (the current token has weight 1)

with q, k and v as given (the caller applies SiLU; there is no ``1/sqrt(d)`` and no softmax) and
``slope [H]`` the caller's (MiniMax derives it from the head and the global layer index). Tokens
are packed: sequence ``s`` owns rows ``cu_seqlens[s]`` to ``cu_seqlens[s + 1]`` and starts from
``initial_state[s]``; rows past ``cu_seqlens[-1]`` are padding (zeros out, no effect on any state).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def recurrent_step(state, q, k, v, slope):
    """One token of every head: state [H, Dk, Dv], q/k [H, Dk], v [H, Dv], slope [H] (float32)
    -> (output [H, Dv], the new state)."""
    state = state * jnp.exp(-slope)[:, None, None] + k[:, :, None] * v[:, None, :]
    return jnp.einsum("hkv,hk->hv", state, q), state


def recurrent_update(state_pool, slots, q, k, v, slope):
    """One decode token per sequence, its state read from and written back to a slot pool:
    state_pool [N, H, Dk, Dv] float32, slots [S] int32 (-1: a padding row, nothing read or written,
    zero output), q/k [S, H, Dk], v [S, H, Dv], slope [H] -> (outputs [S, H, Dv] float32, the pool)."""
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    states = f32(state_pool[jnp.maximum(slots, 0)])
    out, states = jax.vmap(recurrent_step, in_axes=(0, 0, 0, 0, None))(states, f32(q), f32(k), f32(v), f32(slope))
    keep = slots >= 0
    target = jnp.where(keep, slots, state_pool.shape[0])  # out of range: dropped
    state_pool = state_pool.at[target].set(states.astype(state_pool.dtype), mode="drop")
    return jnp.where(keep[:, None, None], out, 0.0), state_pool


def lightning_attention(q, k, v, slope, cu_seqlens, initial_state):
    """q, k [T, H, Dk], v [T, H, Dv], slope [H]; cu_seqlens [S + 1] int32; initial_state
    [S, H, Dk, Dv] -> (outputs [T, H, Dv] float32, final states [S, H, Dk, Dv] float32), token by
    token (a scan over the packed rows)."""
    num_tokens = q.shape[0]
    rows = jnp.arange(num_tokens)
    seq = jnp.searchsorted(cu_seqlens[1:], rows, side="right")  # the sequence of each row
    valid = rows < cu_seqlens[-1]
    first = valid & (rows == cu_seqlens[jnp.minimum(seq, cu_seqlens.shape[0] - 2)])
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    slope = f32(slope)

    def step(carry, xs):
        state, finals = carry
        q_t, k_t, v_t, s_t, valid_t, first_t = xs
        s_t = jnp.minimum(s_t, finals.shape[0] - 1)
        state = jnp.where(first_t, finals[s_t], state)  # a sequence starts from its initial state
        out, new_state = recurrent_step(state, q_t, k_t, v_t, slope)
        state = jnp.where(valid_t, new_state, state)
        finals = jnp.where(valid_t, finals.at[s_t].set(state), finals)
        return (state, finals), jnp.where(valid_t, out, 0.0)

    init = (jnp.zeros(initial_state.shape[1:], jnp.float32), f32(initial_state))
    (_, finals), outputs = jax.lax.scan(step, init, (f32(q), f32(k), f32(v), seq, valid, first))
    return outputs, finals


__all__ = ["lightning_attention", "recurrent_step", "recurrent_update"]
