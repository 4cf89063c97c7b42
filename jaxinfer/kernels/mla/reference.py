"""Plain-jnp multi-head latent attention (DeepSeek-V3's MLA) over a paged latent cache, in absorbed form.

The cache of one MLA layer is ``[num_pages, page_size, kv_lora_rank + rope_dim]`` with no head axis:
row ``slot = page * page_size + offset`` holds one token's ``[latent | k_rope]`` (the kv_a
projection's normed latent and its rotated rope key, one key shared by all heads).

Attention runs in the latent space: the caller absorbs W_UK into the query (``q_latent = q_nope @
W_UK`` per head) and applies W_UV to the output, so a key is ``[latent | k_rope]`` and a value is
the latent itself. The score of key ``j`` is ``(q_latent . latent_j + q_rope . k_rope_j) * scale``
in float32; queries with no visible key (padding) give zeros. These functions are the semantic
truth the GPU kernels are tested against.

``sinks`` (optional, one float32 logit per head, HY-V4): an extra softmax column per head that takes
part in the normalisation and is dropped, as GPT-OSS's attention sinks, so a row sums to less than 1.

An fp8 cache (``kv_cache_dtype="fp8"``) comes with its one scale, ``cache_scale`` (a float32 scalar for
the whole row, latent and rope key alike): rows are written as ``clip(x / scale, -448, 448)`` in e4m3
and read as ``value * scale`` (``jaxinfer.cache.fp8``).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfer.cache import fp8
from jaxinfer.kernels.attention.reference import masked_softmax


def write_latent_cache(cache, latent, k_rope, slot_mapping, *, cache_scale=None):
    """Scatter ``latent [T, R]`` and ``k_rope [T, P]`` into their cache rows -> the new cache.
    Negative slots (padding) are dropped; values are cast to the cache dtype (quantized, for fp8)."""
    fp8.check_scale(cache, cache_scale, "latent")
    num_pages, page_size, width = cache.shape
    if latent.shape[-1] + k_rope.shape[-1] != width:
        raise ValueError(f"latent width {latent.shape[-1]} + rope width {k_rope.shape[-1]} != cache row width {width}")
    num_slots = num_pages * page_size
    rows = jnp.concatenate([fp8.quantize(latent, cache.dtype, cache_scale),
                            fp8.quantize(k_rope, cache.dtype, cache_scale)], axis=-1)
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)  # out of range -> dropped
    flat = cache.reshape(num_slots, width).at[slots].set(rows, mode="drop")
    return flat.reshape(cache.shape)


def _gather_sequences(cache, block_tables, scale=None):
    """``[S, pages_per_seq * page_size, R + P]``: each sequence's cache rows, in position order (an
    fp8 cache's dequantized with its ``scale``)."""
    pages = fp8.dequantize(cache[block_tables], scale)  # [S, pages_per_seq, page_size, R + P]
    num_seqs, pages_per_seq, page_size, width = pages.shape
    return pages.reshape(num_seqs, pages_per_seq * page_size, width)


def latent_attention_probs(q_latent, q_rope, keys, visible, *, scale, sinks=None):
    """q_latent [N, H, R], q_rope [N, H, P]; keys [N, L, R + P] (the cache rows each query sees);
    visible [N, L]; sinks [H] or None -> float32 probabilities [N, H, L], zeros where nothing is visible."""
    latent_dim = q_latent.shape[-1]
    keys = jnp.where(visible[..., None], keys.astype(jnp.float32), 0.0)  # whatever the rows past a length hold
    scores = (jnp.einsum("nhr,nlr->nhl", q_latent.astype(jnp.float32), keys[..., :latent_dim])
              + jnp.einsum("nhp,nlp->nhl", q_rope.astype(jnp.float32), keys[..., latent_dim:])) * scale
    sink = None if sinks is None else sinks.astype(jnp.float32)[None, :, None]
    return masked_softmax(scores, visible[:, None, :], sink)


def _attend_latent(q_latent, q_rope, keys, visible, *, scale, sinks=None):
    """q_latent [N, H, R], q_rope [N, H, P]; keys [N, L, R + P] (the cache rows each query sees);
    visible [N, L] -> [N, H, R] in q_latent's dtype, zeros where nothing is visible."""
    probs = latent_attention_probs(q_latent, q_rope, keys, visible, scale=scale, sinks=sinks)
    latent = jnp.where(visible[..., None], keys[..., :q_latent.shape[-1]].astype(jnp.float32), 0.0)
    return jnp.einsum("nhl,nlr->nhr", probs, latent).astype(q_latent.dtype)


def mla_paged_decode_attention(q_latent, q_rope, cache, block_tables, seq_lens, *, scale, cache_scale=None,
                               sinks=None):
    """One query per sequence, at position ``seq_lens[s] - 1``, over keys ``0 .. seq_lens[s] - 1``.

    q_latent [S, H, R] (q_nope absorbed through W_UK), q_rope [S, H, P] (rotated); cache [pages,
    page_size, R + P]; block_tables [S, pages_per_seq] int32; seq_lens [S] -> [S, H, R] latent values.
    """
    fp8.check_scale(cache, cache_scale, "latent")
    keys = _gather_sequences(cache, block_tables, cache_scale)
    visible = jnp.arange(keys.shape[1])[None, :] < seq_lens[:, None]
    return _attend_latent(q_latent, q_rope, keys, visible, scale=scale, sinks=sinks)


def mla_ragged_paged_attention(q_latent, q_rope, cache, positions, token_seq_ids, block_tables, seq_lens, *, scale,
                               valid=None, cache_scale=None, sinks=None):
    """Prefill / chunked prefill: token ``t`` of sequence ``token_seq_ids[t]`` at ``positions[t]``
    attends keys ``j <= positions[t]`` with ``j < seq_lens[token_seq_ids[t]]`` (the cache already
    holds this step's keys). ``valid [T]`` (optional): False marks padding tokens, which get zeros.

    q_latent [T, H, R], q_rope [T, H, P] -> [T, H, R]. Materialises every token's key rows: the
    truth at small shapes, not a fast path.
    """
    num_seqs = seq_lens.shape[0]
    in_range = (token_seq_ids >= 0) & (token_seq_ids < num_seqs)
    seq_ids = jnp.where(in_range, token_seq_ids, 0)
    fp8.check_scale(cache, cache_scale, "latent")
    keys = _gather_sequences(cache, block_tables, cache_scale)[seq_ids]  # [T, L, R + P]
    key_pos = jnp.arange(keys.shape[1])[None, :]
    visible = (key_pos <= positions[:, None]) & (key_pos < seq_lens[seq_ids][:, None]) & in_range[:, None]
    if valid is not None:
        visible &= valid[:, None]
    return _attend_latent(q_latent, q_rope, keys, visible, scale=scale, sinks=sinks)


__all__ = ["mla_paged_decode_attention", "mla_ragged_paged_attention", "write_latent_cache"]
