"""Plain-jnp mixture-of-experts routing and MLP: the semantic truth for the kernels.

**Routing** (``route``; scores in float32):

* ``softmax_topk`` (Qwen3-MoE, Mixtral, Qwen3-Next): softmax over all experts, top-k, renormalised
  when ``norm_topk_prob``.
* ``sigmoid_bias`` (DeepSeek-V3, MiniMax-M2, Kimi): sigmoid scores; experts are *chosen* by score +
  ``correction_bias`` (optionally within the best ``topk_group`` of ``n_group`` groups, a group scored
  by the sum of its top-2), *weighted* by the unbiased score, normalised when ``norm_topk_prob``
  (``/ (sum + norm_eps)``), then scaled by ``routed_scaling_factor``.
* ``topk_softmax`` (GPT-OSS): top-k of the (biased) router logits, softmax over those k.

Ties go to the lower expert index (``jax.lax.top_k``'s order).

**Expert MLP** (``moe_mlp``):

Every token's ``k`` (token, expert) assignments are sorted by expert so that each expert's rows are
contiguous, the expert MLPs run as grouped matmuls (``jax.lax.ragged_dot``), and the weighted rows
are summed back per token. Weights use nn.Linear's ``[out, in]`` orientation per expert:
``gate``/``up`` ``[E, I, H]``, ``down`` ``[E, H, I]`` (plain arrays, or quantized weights that stand
for them); biases ``[E, I]`` / ``[E, H]`` are optional.

An expert id outside ``[0, E)`` (``-1`` by convention) marks a *dropped* assignment: it belongs to no
group and contributes exactly zero (expert parallelism: an expert another device holds).

Activations: ``"silu"`` is SwiGLU, ``silu(gate) * up``. ``"gpt_oss"`` is GPT-OSS's clamped variant:
``gate = min(gate, limit)``, ``up = clip(up, -limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)``.
``"swiglu_clamp"`` (HY-V4's routed experts) clamps the same way, then plain SwiGLU: ``silu(gate) * up``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.quantization import as_array


ACTIVATIONS = ("silu", "gpt_oss", "swiglu_clamp")


def gated_activation(gate, up, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0):
    if activation == "silu":
        return jax.nn.silu(gate) * up
    if activation == "gpt_oss":
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))
    if activation == "swiglu_clamp":
        return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)
    raise ValueError(f"unknown MoE activation {activation!r}")


ROUTERS = ("softmax_topk", "sigmoid_bias", "topk_softmax")


def route(logits, *, router: str, top_k: int, norm_topk_prob: bool = True, norm_eps: float = 0.0,
          routed_scaling_factor: float = 1.0, n_group: int = 1, topk_group: int = 1, correction_bias=None):
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32)."""
    logits = logits.astype(jnp.float32)
    if router == "softmax_topk":
        weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
        if norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return weights, ids
    if router == "topk_softmax":
        values, ids = jax.lax.top_k(logits, top_k)
        return jax.nn.softmax(values, axis=-1), ids
    if router != "sigmoid_bias":
        raise ValueError(f"unknown router {router!r}; known: {ROUTERS}")
    scores = jax.nn.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)
    if n_group > 1:
        t, e = choice.shape
        grouped = choice.reshape(t, n_group, e // n_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)
        kept = jax.lax.top_k(group_scores, topk_group)[1]
        keep = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], kept].set(True)
        choice = jnp.where(jnp.repeat(keep, e // n_group, axis=1), choice, 0.0)
    ids = jax.lax.top_k(choice, top_k)[1]
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + norm_eps)
    return weights * routed_scaling_factor, ids


def moe_mlp(x, expert_ids, expert_weights, gate, up, down, *, gate_bias=None, up_bias=None, down_bias=None,
            activation: str = "silu", alpha: float = 1.702, limit: float = 7.0, distinct_experts: bool = False):
    """x [T, H]; expert_ids [T, k] int; expert_weights [T, k] -> [T, H] in x's dtype.

    The routing weights (any float dtype) are rounded to x's dtype before they scale the expert
    outputs, as HF casts them to the hidden states' dtype. Ids outside ``[0, E)`` are dropped (they
    add nothing). ``distinct_experts`` (each token's kept ids differ, as top-k routing gives) is a
    promise kernels may use; the reference needs nothing from it. Quantized weights
    (``jaxinfer.quantization``: ``Fp8Weight``, ``Mxfp4Weight``) are dequantized to x's dtype first.
    """
    gate, up, down = (as_array(w, x.dtype) for w in (gate, up, down))
    num_tokens, top_k = expert_ids.shape
    num_experts = gate.shape[0]
    flat = expert_ids.reshape(-1)
    kept = (flat >= 0) & (flat < num_experts)
    flat_experts = jnp.where(kept, flat, num_experts)  # dropped pairs sort last, past every group
    order = jnp.argsort(flat_experts, stable=True)
    rows = x[order // top_k]  # [T*k, H], grouped by expert, dropped pairs at the end
    group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)  # dropped pairs uncounted
    sorted_experts = flat_experts[order]
    sorted_kept = kept[order][:, None]

    def grouped(lhs, w, bias):
        out = jax.lax.ragged_dot(lhs, jnp.swapaxes(w, 1, 2).astype(lhs.dtype), group_sizes)
        if bias is None:
            return out
        rows_bias = bias.astype(out.dtype)[jnp.minimum(sorted_experts, num_experts - 1)]
        return out + jnp.where(sorted_kept, rows_bias, 0)

    hidden = gated_activation(grouped(rows, gate, gate_bias), grouped(rows, up, up_bias), activation, alpha, limit)
    out = grouped(hidden, down, down_bias)  # [T*k, H]
    weighted = out * expert_weights.reshape(-1)[order][:, None].astype(x.dtype).astype(out.dtype)
    weighted = jnp.where(sorted_kept, weighted, 0)  # rows of no group: exactly zero
    # Back to (token, slot) order, then sum each token's k slots.
    unsorted = jnp.zeros_like(weighted).at[order].set(weighted)
    return unsorted.reshape(num_tokens, top_k, -1).sum(axis=1).astype(x.dtype)
