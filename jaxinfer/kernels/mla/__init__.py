"""Multi-head latent attention (DeepSeek-V3's MLA) ops over a paged latent cache, in absorbed form.

Implementations (chosen by ``jaxinfer.kernels.registry``): the plain-jnp reference
(``reference.py``, the semantic truth), and the Pallas decode kernel (``decode_pallas.py``) where
its ``supports`` takes the call, in bf16 / f16 on a GPU (in float32 XLA's fusion of the reference
was faster: docs/performance.md, "MLA decode"; interpreted, at every dtype). The cache write and
the ragged prefill run the reference everywhere. An fp8 cache (``kv_cache_dtype="fp8"``) comes with
its ``cache_scale``: the decode kernel reads its e4m3 rows itself, converting them in registers.
Per-head ``sinks`` (HY-V4) are taken by the reference alone: the decode kernel's ``supports`` refuses them.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfer.cache import fp8
from jaxinfer.kernels.mla import decode_pallas, reference
from jaxinfer.kernels.registry import Implementation, Op, Target


def _decode_kernel_supports(target: Target, q_latent, q_rope, cache, block_tables, seq_lens, *, scale,
                            **tuning) -> bool:
    return (target.runs_pallas and decode_pallas.supports(q_latent, q_rope, cache, **tuning)
            and (target.reads_float8 or not fp8.is_fp8(cache.dtype)))


def _decode_kernel_preferred(target: Target, q_latent, *args, **options) -> bool:
    return target.interpret or q_latent.dtype in (jnp.bfloat16, jnp.float16)


write_latent_cache_op = Op("mla.write_latent_cache", reference.write_latent_cache)
mla_paged_decode_attention_op = Op("mla.mla_paged_decode_attention", reference.mla_paged_decode_attention, (
    Implementation("triton", decode_pallas.mla_paged_decode_attention, _decode_kernel_supports,
                   preferred=_decode_kernel_preferred),
))
mla_ragged_paged_attention_op = Op("mla.mla_ragged_paged_attention", reference.mla_ragged_paged_attention)


def write_latent_cache(cache, latent, k_rope, slot_mapping, **scale):
    """Each token's normed latent and rotated shared key into its cache row -> the cache
    (``cache_scale=`` for an fp8 cache)."""
    return write_latent_cache_op(cache, latent, k_rope, slot_mapping, **scale)


def mla_paged_decode_attention(q_latent, q_rope, cache, block_tables, seq_lens, *, scale, **options):
    """One query token per sequence over its latent pages -> [S, heads, latent] (before W_UV)."""
    return mla_paged_decode_attention_op(q_latent, q_rope, cache, block_tables, seq_lens, scale=scale, **options)


def mla_ragged_paged_attention(q_latent, q_rope, cache, positions, token_seq_ids, block_tables, seq_lens, *, scale,
                               valid=None, **options):
    """Queries of several sequences (any number of new tokens each) over their latent pages
    (``options``: an fp8 cache's ``cache_scale``, per-head ``sinks``)."""
    return mla_ragged_paged_attention_op(q_latent, q_rope, cache, positions, token_seq_ids, block_tables, seq_lens,
                                         scale=scale, valid=valid, **options)


__all__ = ["mla_paged_decode_attention", "mla_ragged_paged_attention", "write_latent_cache"]
