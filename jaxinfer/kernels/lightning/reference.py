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

import jax.numpy as jnp

from jaxinfer.kernels.recurrence import scan_packed, update_slots


def recurrent_step(state, q, k, v, slope):
    """One token of every head: state [H, Dk, Dv], q/k [H, Dk], v [H, Dv], slope [H] (float32)
    -> (output [H, Dv], the new state)."""
    state = state * jnp.exp(-slope)[:, None, None] + k[:, :, None] * v[:, None, :]
    return jnp.einsum("hkv,hk->hv", state, q), state


def recurrent_update(state_pool, slots, q, k, v, slope):
    """One decode token per sequence, its state read from and written back to a slot pool:
    state_pool [N, H, Dk, Dv] float32, slots [S] int32 (-1: a padding row, nothing read or written,
    zero output), q/k [S, H, Dk], v [S, H, Dv], slope [H] -> (outputs [S, H, Dv] float32, the pool)."""
    return update_slots(recurrent_step, state_pool, slots, (q, k, v), shared=(slope,))


def lightning_attention(q, k, v, slope, cu_seqlens, initial_state):
    """q, k [T, H, Dk], v [T, H, Dv], slope [H]; cu_seqlens [S + 1] int32; initial_state
    [S, H, Dk, Dv] -> (outputs [T, H, Dv] float32, final states [S, H, Dk, Dv] float32), token by
    token (a scan over the packed rows)."""
    return scan_packed(recurrent_step, (q, k, v), cu_seqlens, initial_state, shared=(slope,))


__all__ = ["lightning_attention", "recurrent_step", "recurrent_update"]
