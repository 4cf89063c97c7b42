"""Depthwise causal conv1d over packed sequences with state, in plain jnp (gated DeltaNet's and
KDA's short convolutions): the semantic truth.

Channel ``c`` of token ``t`` (sequence ``s``, position ``p`` in this step) is
``act(bias[c] + sum_j weight[c, j] * x[p - (K - 1) + j, c])``, where inputs before the step come
from the sequence's state: its last ``K - 1`` inputs, oldest first (zeros for a fresh sequence:
HF's zero left-padding). The final state is the last ``K - 1`` inputs of state and step together.
Rows past ``cu_seqlens[-1]`` are padding (zeros out).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = {None: lambda x: x, "silu": jax.nn.silu}


def causal_conv1d(x, weight, bias, cu_seqlens, initial_state, *, activation: str | None = "silu"):
    """x [T, C]; weight [C, K]; bias [C] or None; cu_seqlens [S + 1]; initial_state [S, K - 1, C]
    -> (y [T, C] in x's dtype, final states [S, K - 1, C] in the state's dtype)."""
    num_tokens, channels = x.shape
    width = weight.shape[1]
    rows = jnp.arange(num_tokens)
    num_seqs = cu_seqlens.shape[0] - 1
    seq = jnp.minimum(jnp.searchsorted(cu_seqlens[1:], rows, side="right"), num_seqs - 1)
    valid = rows < cu_seqlens[-1]
    position = rows - cu_seqlens[seq]  # in this step
    # The K inputs of each token's window: from the step where the position is >= 0, else the state.
    offset = jnp.arange(width) - (width - 1)  # -(K-1) .. 0
    source = position[:, None] + offset[None, :]  # [T, K]
    from_step = x[jnp.clip(rows[:, None] + offset[None, :], 0, num_tokens - 1)]
    from_state = initial_state[seq[:, None], jnp.clip(width - 1 + source, 0, width - 2)].astype(x.dtype)
    window = jnp.where((source >= 0)[..., None], from_step, from_state)  # [T, K, C]
    y = jnp.einsum("tkc,ck->tc", window.astype(jnp.float32), weight.astype(jnp.float32))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    y = jnp.where(valid[:, None], ACTIVATIONS[activation](y), 0.0).astype(x.dtype)
    # Final state: the last K - 1 inputs of [state | the sequence's step rows].
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    last = jnp.arange(width - 1) - (width - 1)  # -(K-1) .. -1, relative to the end
    back = lengths[:, None] + last[None, :]  # position in the step
    step_rows = jnp.clip(cu_seqlens[:-1, None] + back, 0, num_tokens - 1)
    state_rows = jnp.clip(width - 1 + back, 0, width - 2)
    final = jnp.where((back >= 0)[..., None], x[step_rows].astype(initial_state.dtype),
                      jnp.take_along_axis(initial_state, state_rows[..., None], axis=1))
    return y, final


def causal_conv1d_step(x, weight, bias, state, *, activation: str | None = "silu"):
    """One token per sequence: x [S, C], state [S, K - 1, C] -> (y [S, C], the new state)."""
    window = jnp.concatenate([state.astype(x.dtype), x[:, None, :]], axis=1)  # [S, K, C]
    y = jnp.einsum("skc,ck->sc", window.astype(jnp.float32), weight.astype(jnp.float32))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return ACTIVATIONS[activation](y).astype(x.dtype), window[:, 1:].astype(state.dtype)


__all__ = ["ACTIVATIONS", "causal_conv1d", "causal_conv1d_step"]
