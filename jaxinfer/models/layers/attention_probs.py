"""MLA attention probabilities from a layer's queries and its paged latent cache, for the research
forward's ``attentions`` capture (HF's ``output_attentions`` with eager attention); GQA layers take
theirs from ``attention.reference.ragged_attention_probs``.

The maths is the MLA reference's own (``mla.reference.latent_attention_probs``): every token's row
spans its sequence's ``pages_per_seq * page_size`` key positions, masked keys get 0, padding tokens
rows of zeros; for sparse attention only the keys the indexer selected are visible.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfer.kernels.mla import reference as mla_reference


def latent_attention_probs(q_latent, q_rope, latent_cache, positions, token_seq_ids, block_tables, *, scale,
                           selected_slots=None):
    """MLA in absorbed form: q_latent [T, H, R], q_rope [T, H, P] (rotated), latent_cache
    [num_pages, page_size, R + P] -> float32 [T, H, pages_per_seq * page_size]. ``selected_slots
    [T, K]`` (sparse attention; cache rows, -1: none): only those keys are visible."""
    page_size = latent_cache.shape[1]
    seq = jnp.maximum(token_seq_ids, 0)
    keys = mla_reference._gather_sequences(latent_cache, block_tables)[seq]  # [T, L, R + P]
    key_pos = jnp.arange(keys.shape[1])[None, :]
    visible = (key_pos <= positions[:, None]) & (token_seq_ids >= 0)[:, None]
    if selected_slots is not None:
        rows = block_tables[seq][:, key_pos[0] // page_size] * page_size + key_pos % page_size  # [T, L]
        visible &= jnp.any(rows[:, :, None] == selected_slots[:, None, :], axis=-1)
    return mla_reference.latent_attention_probs(q_latent, q_rope, keys, visible, scale=scale)


__all__ = ["latent_attention_probs"]
