"""Kimi Delta Attention (KDA, Kimi Linear) token by token: the semantic truth.

KDA is the gated delta rule with a decay per key channel rather than one per head. Per head, a
state ``S [Dk, Dv]`` (float32) evolves with each token ``t`` of a sequence:

    S = exp(g_t)[:, None] * S           (decay of each key channel; g_t [Dk] <= 0)
    u = beta_t * (v_t - S^T k_t)        (the delta, scaled by the write strength)
    S = S + k_t u^T
    o_t = S^T q_t

with q and k as given (the caller L2-normalises them and scales q by ``Dk ** -0.5``, as HF's
``recurrent_kimi_delta_attention`` does inside with ``use_qk_l2norm_in_kernel``). Tokens are packed:
sequence ``s`` owns rows ``cu_seqlens[s]`` to ``cu_seqlens[s + 1]`` and starts from
``initial_state[s]``; rows past ``cu_seqlens[-1]`` are padding (zeros out, no effect on any state).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfer.kernels.recurrence import scan_packed, update_slots


def recurrent_step(state, q, k, v, g, beta):
    """One token of every head: state [H, Dk, Dv], q/k [H, Dk], v [H, Dv], g [H, Dk], beta [H]
    (float32) -> (output [H, Dv], the new state)."""
    state = state * jnp.exp(g)[:, :, None]
    delta = beta[:, None] * (v - jnp.einsum("hkv,hk->hv", state, k))
    state = state + k[:, :, None] * delta[:, None, :]
    return jnp.einsum("hkv,hk->hv", state, q), state


def recurrent_update(state_pool, slots, q, k, v, g, beta):
    """One decode token per sequence, its state read from and written back to a slot pool:
    state_pool [N, H, Dk, Dv] float32, slots [S] int32 (-1: a padding row, nothing read or written),
    q/k/g [S, H, Dk], v [S, H, Dv], beta [S, H] -> (outputs [S, H, Dv] float32, the pool)."""
    return update_slots(recurrent_step, state_pool, slots, (q, k, v, g, beta))


def kda(q, k, v, g, beta, cu_seqlens, initial_state):
    """q, k, g [T, H, Dk], v [T, H, Dv], beta [T, H]; cu_seqlens [S + 1] int32; initial_state
    [S, H, Dk, Dv] -> (outputs [T, H, Dv] float32, final states [S, H, Dk, Dv] float32), token by
    token (a scan over the packed rows)."""
    return scan_packed(recurrent_step, (q, k, v, g, beta), cu_seqlens, initial_state)


__all__ = ["kda", "recurrent_step", "recurrent_update"]
