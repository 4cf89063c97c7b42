"""Plain-jnp mixture-of-experts MLP: the semantic truth for the grouped-GEMM kernels.

Every token's ``k`` (token, expert) assignments are sorted by expert so that each expert's rows are
contiguous, the expert MLPs run as grouped matmuls (``jax.lax.ragged_dot``), and the weighted rows
are summed back per token. Weights use nn.Linear's ``[out, in]`` orientation per expert:
``gate``/``up`` ``[E, I, H]``, ``down`` ``[E, H, I]``; biases ``[E, I]`` / ``[E, H]`` are optional.

Activations: ``"silu"`` is SwiGLU, ``silu(gate) * up``. ``"gpt_oss"`` is GPT-OSS's clamped variant:
``gate = min(gate, limit)``, ``up = clip(up, -limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gated_activation(gate, up, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0):
    if activation == "silu":
        return jax.nn.silu(gate) * up
    if activation == "gpt_oss":
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))
    raise ValueError(f"unknown MoE activation {activation!r}")


def moe_mlp(x, expert_ids, expert_weights, gate, up, down, *, gate_bias=None, up_bias=None, down_bias=None,
            activation: str = "silu", alpha: float = 1.702, limit: float = 7.0, distinct_experts: bool = False):
    """x [T, H]; expert_ids [T, k] int; expert_weights [T, k] -> [T, H] in x's dtype.

    ``distinct_experts`` (each token's k ids differ, as top-k routing gives) is a promise kernels
    may use; the reference needs nothing from it.
    """
    num_tokens, top_k = expert_ids.shape
    num_experts = gate.shape[0]
    flat_experts = expert_ids.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)
    rows = x[order // top_k]  # [T*k, H], grouped by expert
    group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)
    sorted_experts = flat_experts[order]

    def grouped(lhs, w, bias):
        out = jax.lax.ragged_dot(lhs, jnp.swapaxes(w, 1, 2).astype(lhs.dtype), group_sizes)
        return out if bias is None else out + bias.astype(out.dtype)[sorted_experts]

    hidden = gated_activation(grouped(rows, gate, gate_bias), grouped(rows, up, up_bias), activation, alpha, limit)
    out = grouped(hidden, down, down_bias)  # [T*k, H]
    weighted = out * expert_weights.reshape(-1)[order][:, None].astype(out.dtype)
    # Back to (token, slot) order, then sum each token's k slots.
    unsorted = jnp.zeros_like(weighted).at[order].set(weighted)
    return unsorted.reshape(num_tokens, top_k, -1).sum(axis=1).astype(x.dtype)
