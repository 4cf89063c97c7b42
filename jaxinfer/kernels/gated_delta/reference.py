"""The gated delta rule (gated DeltaNet, Qwen3-Next / Qwen3.5) token by token: the semantic truth.

Per value head, a state ``S [Dk, Dv]`` (float32) evolves with each token ``t`` of a sequence:

    S = exp(g_t) * S                    (decay; g_t <= 0)
    u = beta_t * (v_t - S^T k_t)        (the delta, scaled by the write strength)
    S = S + k_t u^T
    o_t = S^T q_t

with q and k as given (the caller L2-normalises them and scales q by ``Dk ** -0.5``, as HF's
``torch_recurrent_gated_delta_rule`` does inside). Tokens are packed: sequence ``s`` owns rows
``cu_seqlens[s]`` to ``cu_seqlens[s + 1]`` and starts from ``initial_state[s]``; rows past
``cu_seqlens[-1]`` are padding (zeros out, no effect on any state).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfer.kernels.recurrence import scan_packed, update_slots


def recurrent_step(state, q, k, v, g, beta):
    """One token of every head: state [H, Dk, Dv], q/k [H, Dk], v [H, Dv], g/beta [H] (float32)
    -> (output [H, Dv], the new state)."""
    state = state * jnp.exp(g)[:, None, None]
    delta = beta[:, None] * (v - jnp.einsum("hkv,hk->hv", state, k))
    state = state + k[:, :, None] * delta[:, None, :]
    return jnp.einsum("hkv,hk->hv", state, q), state


def recurrent_update(state_pool, slots, q, k, v, g, beta):
    """One decode token per sequence, its state read from and written back to a slot pool:
    state_pool [N, H, Dk, Dv] float32, slots [S] int32 (-1: a padding row, nothing read or written),
    q/k [S, H, Dk], v [S, H, Dv], g/beta [S, H] -> (outputs [S, H, Dv] float32, the pool)."""
    return update_slots(recurrent_step, state_pool, slots, (q, k, v, g, beta))


def gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state):
    """q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H]; cu_seqlens [S + 1] int32; initial_state
    [S, H, Dk, Dv] -> (outputs [T, H, Dv] float32, final states [S, H, Dk, Dv] float32), token by
    token (a scan over the packed rows)."""
    return scan_packed(recurrent_step, (q, k, v, g, beta), cu_seqlens, initial_state)


__all__ = ["gated_delta_rule", "recurrent_step", "recurrent_update"]
