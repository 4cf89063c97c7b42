"""Multi-head latent attention (DeepSeek-V3's MLA) ops over a paged latent cache, in absorbed form.

Models call these functions; each dispatches to an implementation chosen by platform: the plain-jnp
reference (``reference.py``, the semantic truth) on CPU; on GPU the Pallas decode kernel
(``decode_pallas.py``) where its ``supports`` takes the call, else the reference. The cache write and
the ragged prefill run the reference everywhere. ``set_implementation("reference")`` forces the
reference (for debugging and for measuring what the kernel buys).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfer.kernels.dispatch import OpDispatcher
from jaxinfer.kernels.mla import decode_pallas, reference


def _decode_where_faster(q_latent, q_rope, cache, block_tables, seq_lens, *, scale, interpret=False, **tuning):
    """The Pallas kernel where ``decode_pallas.supports`` takes the call in bf16 / f16, else the
    reference: in float32 XLA's fusion of the reference was faster on the H200 (44 against 68 us at
    5 sequences of 1000 tokens, ``docs/performance.md``, "MLA decode")."""
    half = q_latent.dtype in (jnp.bfloat16, jnp.float16)
    if (half or interpret) and decode_pallas.supports(q_latent, q_rope, cache, **tuning):
        return decode_pallas.mla_paged_decode_attention(q_latent, q_rope, cache, block_tables, seq_lens, scale=scale,
                                                        interpret=interpret, **tuning)
    return reference.mla_paged_decode_attention(q_latent, q_rope, cache, block_tables, seq_lens, scale=scale)


_dispatch = OpDispatcher(
    "MLA",
    {
        "reference": {
            "write_latent_cache": reference.write_latent_cache,
            "mla_paged_decode_attention": reference.mla_paged_decode_attention,
            "mla_ragged_paged_attention": reference.mla_ragged_paged_attention,
        },
        "pallas": {"mla_paged_decode_attention": _decode_where_faster},
    },
    {"gpu": "pallas", "cuda": "pallas"},
)
set_implementation = _dispatch.set_implementation
implementation_name = _dispatch.implementation_name


def write_latent_cache(cache, latent, k_rope, slot_mapping):
    return _dispatch("write_latent_cache")(cache, latent, k_rope, slot_mapping)


def mla_paged_decode_attention(q_latent, q_rope, cache, block_tables, seq_lens, *, scale, **options):
    return _dispatch("mla_paged_decode_attention")(q_latent, q_rope, cache, block_tables, seq_lens, scale=scale,
                                                   **options)


def mla_ragged_paged_attention(q_latent, q_rope, cache, positions, token_seq_ids, block_tables, seq_lens, *, scale,
                               valid=None):
    return _dispatch("mla_ragged_paged_attention")(q_latent, q_rope, cache, positions, token_seq_ids, block_tables,
                                                   seq_lens, scale=scale, valid=valid)


__all__ = ["implementation_name", "mla_paged_decode_attention", "mla_ragged_paged_attention", "set_implementation",
           "write_latent_cache"]
