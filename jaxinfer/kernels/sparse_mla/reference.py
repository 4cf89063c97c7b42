"""Plain-jnp DeepSeek sparse attention (DSA): the lightning indexer, the top-k selection, and MLA
attention over the selected cache rows. The semantic truth for the tiled path and the kernels.

**Indexer.** Each query token ``t`` has ``H`` indexer heads ``q[t, h]`` (width ``D``) and per-head
weights ``w[t, h]``; each cached token ``j`` one key ``k[j]`` (the paged side cache
``[num_pages, page_size, D]``). The score of key ``j`` for token ``t`` is
``sum_h w[t, h] * relu(scale * q[t, h] . k[j])`` in float32, over the keys ``j <= positions[t]`` of
the token's sequence (HF's ``DeepseekV32Indexer``; HF's ``weights_proj`` output times
``H ** -0.5`` is ``w``, ``head_dim ** -0.5`` is ``scale``).

**Selection.** The ``top_k`` best keys per token as cache slots (``page * page_size + offset``),
best first; equal scores go to the lower position (``lax.top_k``'s order); -1 where the token sees
fewer than ``top_k`` keys, and for padding tokens.

**Sparse attention.** MLA in absorbed form (``jaxinfer.kernels.mla.reference``) over each token's
selected rows of the latent cache alone; optional per-head ``sinks`` (HY-V4) join each head's
softmax as an extra column that is dropped (``jaxinfer.kernels.mla.reference``).

**fp8 caches** (``kv_cache_dtype="fp8"``): the index keys and the latent rows come with their
``cache_scale``; writes quantize and reads dequantize (``jaxinfer.cache.fp8``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.cache import fp8
from jaxinfer.kernels.mla.reference import _attend_latent, _gather_sequences


def write_index_keys(cache, keys, slot_mapping, *, cache_scale=None):
    """Scatter ``keys [T, D]`` into their rows of ``cache [num_pages, page_size, D]``; negative slots
    (padding) are dropped, values cast to the cache dtype."""
    fp8.check_scale(cache, cache_scale, "index key")
    num_pages, page_size, width = cache.shape
    if keys.shape[-1] != width:
        raise ValueError(f"index keys of width {keys.shape[-1]} for a cache of width {width}")
    num_slots = num_pages * page_size
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)
    flat = cache.reshape(num_slots, width).at[slots].set(fp8.quantize(keys, cache.dtype, cache_scale), mode="drop")
    return flat.reshape(cache.shape)


def indexer_scores(q, weights, index_cache, positions, token_seq_ids, block_tables, *, scale, cache_scale=None):
    """q [T, H, D], weights [T, H] -> float32 scores [T, pages_per_seq * page_size] over each token's
    sequence in position order, -inf at keys it does not see (later positions; every key of a
    padding token)."""
    fp8.check_scale(index_cache, cache_scale, "index key")
    seq = jnp.maximum(token_seq_ids, 0)
    keys = _gather_sequences(index_cache, block_tables, cache_scale)[seq].astype(jnp.float32)  # [T, L, D]
    per_head = jax.nn.relu(jnp.einsum("thd,tld->thl", q.astype(jnp.float32), keys) * scale)
    scores = jnp.einsum("th,thl->tl", weights.astype(jnp.float32), per_head)
    visible = (jnp.arange(keys.shape[1])[None, :] <= positions[:, None]) & (token_seq_ids >= 0)[:, None]
    return jnp.where(visible, scores, -jnp.inf)


def select_slots(scores, token_seq_ids, block_tables, *, top_k: int, page_size: int):
    """The ``top_k`` best keys of each row of ``scores [T, L]`` (positions of the token's sequence) as
    cache slots ``[T, top_k]`` int32, best first, -1 for none (fewer visible keys than ``top_k``)."""
    num_keys = scores.shape[1]
    k = min(top_k, num_keys)
    best, position = jax.lax.top_k(scores, k)
    tables = block_tables[jnp.maximum(token_seq_ids, 0)]  # [T, pages_per_seq]
    page = jnp.take_along_axis(tables, position // page_size, axis=1)
    slots = jnp.where(jnp.isfinite(best), page * page_size + position % page_size, -1).astype(jnp.int32)
    if k < top_k:
        slots = jnp.pad(slots, ((0, 0), (0, top_k - k)), constant_values=-1)
    return slots


def indexer_select(q, weights, index_cache, positions, token_seq_ids, block_tables, *, scale, top_k: int,
                   cache_scale=None):
    """``indexer_scores`` then ``select_slots``: each token's selected cache slots ``[T, top_k]``."""
    scores = indexer_scores(q, weights, index_cache, positions, token_seq_ids, block_tables, scale=scale,
                            cache_scale=cache_scale)
    return select_slots(scores, token_seq_ids, block_tables, top_k=top_k, page_size=index_cache.shape[1])


def sparse_mla_attention(q_latent, q_rope, latent_cache, slots, *, scale, cache_scale=None, sinks=None):
    """q_latent [T, H, R], q_rope [T, H, P]; latent_cache [num_pages, page_size, R + P]; slots
    [T, K] (-1: none); sinks [H] or None -> [T, H, R]: each token attends to its selected rows alone
    (zeros where it has none)."""
    fp8.check_scale(latent_cache, cache_scale, "latent")
    num_pages, page_size, width = latent_cache.shape
    rows = latent_cache.reshape(num_pages * page_size, width)[jnp.maximum(slots, 0)]  # [T, K, R + P]
    rows = fp8.dequantize(rows, cache_scale)
    return _attend_latent(q_latent, q_rope, rows, slots >= 0, scale=scale, sinks=sinks)


__all__ = ["indexer_scores", "indexer_select", "select_slots", "sparse_mla_attention", "write_index_keys"]
