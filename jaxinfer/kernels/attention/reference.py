"""Plain-jnp paged attention: the semantic truth the GPU kernels are tested against.

Scores are computed in float32. A key at position ``j`` is visible to a query at position ``p`` of
the same sequence when ``j <= p``, ``j < seq_len`` and, with a sliding window ``W``, ``j > p - W``
(HF's window semantics); the rows a query cannot see count for nothing, whatever they hold (a NaN
left in a freed page by a request whose activations overflowed included). Optional extras:
``logit_softcap`` (``cap * tanh(s / cap)``) and ``sinks`` (one learned logit per query head, an extra
softmax column that is dropped afterwards).

An fp8 cache (``kv_cache_dtype="fp8"``) comes with its scales ``k_scale`` / ``v_scale`` (float32
scalars): rows are written as ``clip(x / scale, -448, 448)`` in e4m3 and read as ``value * scale``
(``jaxinfer.cache.fp8``); a cache in the compute dtype takes none.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfer.cache import fp8
from jaxinfer.kernels.math import apply_rotary, rms_norm


def write_kv_cache(k_cache, v_cache, k, v, slot_mapping, *, k_scale=None, v_scale=None):
    """Scatter new K/V rows [T, kv_heads, head_dim] into their slots; negative slots are dropped.

    Caches are ``[kv_heads, num_pages, page_size, head_dim]``; slot = page * page_size + offset.
    """
    fp8.check_scale(k_cache, k_scale, "K")
    fp8.check_scale(v_cache, v_scale, "V")
    kv_heads, num_pages, page_size, head_dim = k_cache.shape
    num_slots = num_pages * page_size
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)  # out of range -> dropped

    def scatter(cache, rows, scale):
        flat = cache.reshape(kv_heads, num_slots, head_dim)
        flat = flat.at[:, slots].set(fp8.quantize(rows.swapaxes(0, 1), cache.dtype, scale), mode="drop")
        return flat.reshape(cache.shape)

    return scatter(k_cache, k, k_scale), scatter(v_cache, v, v_scale)


def check_qk_norm(q_norm, k_norm):
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm go together: pass both norm weights or neither")


def rotary_cache_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, *, q_norm=None, k_norm=None,
                       norm_eps: float = 1e-6, k_scale=None, v_scale=None):
    """The step between the q/k/v projections and attention: optional per-head RMSNorm of q and k
    (weights ``q_norm``/``k_norm`` [head_dim], Qwen3's), RoPE on both, then k and v into the cache.

    q [T, heads, d], k/v [T, kv_heads, d], cos/sin [T, rotary_dim] float32 -> (q, k_cache, v_cache).
    """
    check_qk_norm(q_norm, k_norm)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, norm_eps), rms_norm(k, k_norm, norm_eps)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    return (q, *write_kv_cache(k_cache, v_cache, k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale))


def _gather_sequences(cache, block_tables, scale=None):
    """[S, pages_per_seq * page_size, kv_heads, head_dim]: each sequence's cache, in order (an fp8
    cache's rows dequantized with its ``scale``)."""
    pages = fp8.dequantize(cache[:, block_tables], scale)  # [kv, S, P, page_size, d]
    kv, s, p, page_size, d = pages.shape
    return pages.reshape(kv, s, p * page_size, d).transpose(1, 2, 0, 3)


def masked_softmax(scores, visible, sinks=None):
    """Softmax of float32 ``scores`` over the last axis where ``visible`` (broadcast); ``sinks``
    (broadcast to one extra column) take part and are dropped, so such rows sum to less than 1.
    Rows with nothing visible (padding) give zeros instead of NaNs."""
    scores = jnp.where(visible, scores, -jnp.inf)
    if sinks is not None:
        scores = jnp.concatenate([scores, jnp.broadcast_to(sinks, scores.shape[:-1] + (1,))], axis=-1)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(scores - row_max)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(denom == 0, 1.0, denom)
    return probs[..., :-1] if sinks is not None else probs


def attention_probs(q, k, visible, *, scale, logit_softcap=None, sinks=None):
    """q [N, kv, g, d]; k [N, L, kv, d]; visible [N, L] -> float32 probabilities [N, kv, g, L]:
    scores times ``scale``, soft-capped, softmax over the visible keys (with the sinks [kv * g])."""
    scores = jnp.einsum("nkgd,nlkd->nkgl", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    if logit_softcap:
        scores = logit_softcap * jnp.tanh(scores / logit_softcap)
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(q.shape[1], q.shape[2], 1)
    return masked_softmax(scores, visible[:, None, None, :], sink)


def _attend(q, k, v, visible, *, scale, logit_softcap, sinks):
    """q [N, kv, g, d]; k, v [N, L, kv, d]; visible [N, L] -> [N, kv, g, d] in q's dtype."""
    probs = attention_probs(q, k, visible, scale=scale, logit_softcap=logit_softcap, sinks=sinks)
    # Whatever the rows a query cannot see hold (a freed page's NaN / Inf included), not 0 * NaN.
    v = jnp.where(visible[:, :, None, None], v.astype(jnp.float32), 0.0)
    out = jnp.einsum("nkgl,nlkd->nkgd", probs, v)
    return out.astype(q.dtype)


def _visible(query_pos, seq_len, num_keys, sliding_window):
    key_pos = jnp.arange(num_keys)[None, :]
    visible = (key_pos <= query_pos[:, None]) & (key_pos < seq_len[:, None])
    if sliding_window:
        visible &= key_pos > query_pos[:, None] - sliding_window
    return visible


def ragged_paged_attention(q, k_cache, v_cache, positions, token_seq_ids, block_tables, seq_lens, *, scale,
                           sliding_window=None, logit_softcap=None, sinks=None, k_scale=None, v_scale=None):
    """Queries [T, heads, d] from several sequences (any number of new tokens each) over the cache:
    token ``t`` of sequence ``token_seq_ids[t]`` (-1: padding, which gets zeros) at ``positions[t]``;
    sequence ``s`` holds ``seq_lens[s]`` tokens in the pages ``block_tables[s]``."""
    t, heads, d = q.shape
    kv_heads = k_cache.shape[0]
    fp8.check_scale(k_cache, k_scale, "K")
    fp8.check_scale(v_cache, v_scale, "V")
    seq = jnp.maximum(token_seq_ids, 0)
    k = _gather_sequences(k_cache, block_tables, k_scale)[seq]
    v = _gather_sequences(v_cache, block_tables, v_scale)[seq]
    visible = _visible(positions, jnp.where(token_seq_ids >= 0, seq_lens[seq], 0), k.shape[1], sliding_window)
    out = _attend(q.reshape(t, kv_heads, heads // kv_heads, d), k, v, visible,
                  scale=scale, logit_softcap=logit_softcap, sinks=sinks)
    return out.reshape(t, heads, d)


def ragged_attention_probs(q, k_cache, positions, token_seq_ids, block_tables, seq_lens, *, scale,
                           sliding_window=None, logit_softcap=None, sinks=None, k_scale=None, v_scale=None):
    """The probabilities ``ragged_paged_attention`` weights the values with: float32 [T, heads,
    pages_per_seq * page_size], each token's row over its sequence's key positions (0 where masked,
    all 0 for padding tokens)."""
    t, heads, d = q.shape
    kv_heads = k_cache.shape[0]
    fp8.check_scale(k_cache, k_scale, "K")
    seq = jnp.maximum(token_seq_ids, 0)
    k = _gather_sequences(k_cache, block_tables, k_scale)[seq]
    visible = _visible(positions, jnp.where(token_seq_ids >= 0, seq_lens[seq], 0), k.shape[1], sliding_window)
    probs = attention_probs(q.reshape(t, kv_heads, heads // kv_heads, d), k, visible, scale=scale,
                            logit_softcap=logit_softcap, sinks=sinks)
    return probs.reshape(t, heads, k.shape[1])


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, *, scale, sliding_window=None,
                           logit_softcap=None, sinks=None, k_scale=None, v_scale=None):
    """One query per sequence [S, heads, d], at position ``seq_lens[s] - 1``."""
    fp8.check_scale(k_cache, k_scale, "K")
    fp8.check_scale(v_cache, v_scale, "V")
    s, heads, d = q.shape
    kv_heads = k_cache.shape[0]
    k = _gather_sequences(k_cache, block_tables, k_scale)
    v = _gather_sequences(v_cache, block_tables, v_scale)
    visible = _visible(seq_lens - 1, seq_lens, k.shape[1], sliding_window)
    out = _attend(q.reshape(s, kv_heads, heads // kv_heads, d), k, v, visible,
                  scale=scale, logit_softcap=logit_softcap, sinks=sinks)
    return out.reshape(s, heads, d)


def rotary_paged_decode_attention(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens, *,
                                  scale, q_norm=None, k_norm=None, norm_eps: float = 1e-6, sliding_window=None,
                                  logit_softcap=None, sinks=None, k_scale=None, v_scale=None):
    """A decode step's attention from the projections on: ``rotary_cache_write`` then
    ``paged_decode_attention`` (token ``s`` is sequence ``s``'s new last token, at position
    ``seq_lens[s] - 1`` in slot ``slot_mapping[s]``). -> (out [S, heads, d], k_cache, v_cache)."""
    q, k_cache, v_cache = rotary_cache_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_norm=q_norm,
                                             k_norm=k_norm, norm_eps=norm_eps, k_scale=k_scale, v_scale=v_scale)
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                 sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks,
                                 k_scale=k_scale, v_scale=v_scale)
    return out, k_cache, v_cache


def dense_causal_attention(q, k, v, *, scale, sliding_window=None, logit_softcap=None, sinks=None):
    """No cache: q [T, heads, d], k/v [T, kv_heads, d] of one sequence. For tests and notebooks."""
    t, heads, d = q.shape
    kv_heads = k.shape[1]
    positions = jnp.arange(t)
    visible = _visible(positions, jnp.full((t,), t), t, sliding_window)
    out = _attend(q.reshape(t, kv_heads, heads // kv_heads, d), jnp.broadcast_to(k, (t,) + k.shape),
                  jnp.broadcast_to(v, (t,) + v.shape), visible,
                  scale=scale, logit_softcap=logit_softcap, sinks=sinks)
    return out.reshape(t, heads, d)


__all__ = ["dense_causal_attention", "paged_decode_attention", "ragged_paged_attention", "rotary_cache_write",
           "rotary_paged_decode_attention", "write_kv_cache"]
