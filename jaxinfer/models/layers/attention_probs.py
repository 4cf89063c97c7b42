"""Attention probabilities in plain jnp, from a layer's rotated queries and its paged cache, for the
research forward's ``attentions`` capture (HF's ``output_attentions`` with eager attention).

The maths is the attention references' (``jaxinfer.kernels.attention.reference``,
``jaxinfer.kernels.mla.reference``, ``jaxinfer.kernels.sparse_mla.reference``): float32 scores times
the layer's scale, an optional soft-cap, the causal mask of the token's own sequence (and its sliding
window), an optional sink column that is dropped after the softmax (rows then sum to less than 1),
and for sparse attention only the keys the indexer selected. Every token's row spans its sequence's
``pages_per_seq * page_size`` key positions; masked keys get 0. Padding tokens get rows of zeros.
"""

from __future__ import annotations

import jax.numpy as jnp


def _softmax(scores, visible, sinks=None):
    """Softmax over the last axis of ``scores`` where ``visible``; ``sinks`` (broadcast to one extra
    column) take part and are dropped. Rows with nothing visible give zeros."""
    scores = jnp.where(visible, scores, -jnp.inf)
    if sinks is not None:
        scores = jnp.concatenate([scores, jnp.broadcast_to(sinks, scores.shape[:-1] + (1,))], axis=-1)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(denom == 0, 1.0, denom)
    return probs[..., :-1] if sinks is not None else probs


def _key_positions(num_keys):
    return jnp.arange(num_keys)[None, :]


def paged_attention_probs(q, k_cache, positions, token_seq_ids, block_tables, seq_lens, *, scale,
                          sliding_window=None, logit_softcap=None, sinks=None):
    """GQA: q [T, heads, d] (rotated), k_cache [kv_heads, num_pages, page_size, d] -> float32
    [T, heads, pages_per_seq * page_size]. KV head ``j`` serves query heads ``[j*g, (j+1)*g)``;
    ``sinks`` [heads]; a key is visible when ``j <= position``, ``j < seq_len`` and, with a window
    ``W``, ``j > position - W``."""
    t, heads, d = q.shape
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    seq = jnp.maximum(token_seq_ids, 0)
    pages = k_cache[:, block_tables]  # [kv, S, P, page_size, d]
    keys = pages.reshape(kv_heads, block_tables.shape[0], -1, d).transpose(1, 2, 0, 3)[seq]  # [T, L, kv, d]
    scores = jnp.einsum("tkgd,tlkd->tkgl", q.reshape(t, kv_heads, group, d).astype(jnp.float32),
                        keys.astype(jnp.float32)) * scale
    if logit_softcap:
        scores = logit_softcap * jnp.tanh(scores / logit_softcap)
    key_pos = _key_positions(keys.shape[1])
    seq_len = jnp.where(token_seq_ids >= 0, seq_lens[seq], 0)
    visible = (key_pos <= positions[:, None]) & (key_pos < seq_len[:, None])
    if sliding_window:
        visible &= key_pos > positions[:, None] - sliding_window
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(1, kv_heads, group, 1)
    probs = _softmax(scores, visible[:, None, None, :], sink)
    return probs.reshape(t, heads, keys.shape[1])


def latent_attention_probs(q_latent, q_rope, latent_cache, positions, token_seq_ids, block_tables, *, scale,
                           selected_slots=None):
    """MLA in absorbed form: q_latent [T, H, R], q_rope [T, H, P] (rotated), latent_cache
    [num_pages, page_size, R + P] -> float32 [T, H, pages_per_seq * page_size]; the score of key
    ``j`` is ``(q_latent . latent_j + q_rope . k_rope_j) * scale``. ``selected_slots [T, K]``
    (sparse attention; cache rows, -1: none): only those keys are visible."""
    latent_dim = q_latent.shape[-1]
    num_seqs, pages_per_seq = block_tables.shape
    page_size, width = latent_cache.shape[1:]
    seq = jnp.maximum(token_seq_ids, 0)
    keys = latent_cache[block_tables].reshape(num_seqs, pages_per_seq * page_size, width)[seq].astype(jnp.float32)
    scores = (jnp.einsum("thr,tlr->thl", q_latent.astype(jnp.float32), keys[..., :latent_dim])
              + jnp.einsum("thp,tlp->thl", q_rope.astype(jnp.float32), keys[..., latent_dim:])) * scale
    key_pos = _key_positions(keys.shape[1])
    visible = (key_pos <= positions[:, None]) & (token_seq_ids >= 0)[:, None]
    if selected_slots is not None:
        rows = block_tables[seq][:, key_pos[0] // page_size] * page_size + key_pos % page_size  # [T, L]
        visible &= jnp.any(rows[:, :, None] == selected_slots[:, None, :], axis=-1)
    return _softmax(scores, visible[:, None, :])


__all__ = ["latent_attention_probs", "paged_attention_probs"]
