"""DeepSeek sparse attention (DSA) ops: the indexer's key cache write, its top-k selection over the
paged keys, and MLA attention over the selected latent rows.

**The interface** (what block-level variants plug into): a *selection* is ``slots [T, K]`` int32,
rows of the paged cache (``page * page_size + offset``) that token ``t`` attends to, -1 for none.
``indexer_select`` makes one from the indexer's queries and the cached keys; ``sparse_mla_attention``
consumes one and never looks at how it was made. A variant that selects whole 64- or 128-token
blocks, or scores pooled keys, produces the slots of the blocks it picks (or of pooled rows in a
side cache); a layer that shares the previous layer's selection passes the same slots on.

Implementations (``jaxinfer.kernels.registry``): the plain-jnp reference (``reference.py``, dense
over each token's sequence: the truth at small shapes); the query-tiled jnp path (``tiled.py``),
which never holds a score or mask matrix over the whole step, wherever no kernel takes the call;
and the Pallas (Triton lowering) kernels where Pallas runs: ``attention_pallas.py`` (each token over
its selected rows, prefill and decode alike) and ``indexer_pallas.py`` (the indexer's scores over
the paged keys, then XLA's top-k, in query tiles). fp8 caches (``kv_cache_dtype="fp8"``, with their
``cache_scale``): both kernels read the e4m3 rows themselves where Pallas reads e4m3
(``Target.reads_float8``), else the tiled path serves them.
"""

from __future__ import annotations

from jaxinfer.cache import fp8
from jaxinfer.kernels.registry import Implementation, Op
from jaxinfer.kernels.sparse_mla import attention_pallas, indexer_pallas, reference, tiled


def _any_call(target, *args, **options) -> bool:
    return True


def _indexer_kernel_supports(target, q, weights, index_cache, *args, **options) -> bool:
    return (target.runs_pallas and (target.reads_float8 or not fp8.is_fp8(index_cache.dtype))
            and indexer_pallas.supports(q, weights, index_cache, *args, **options))


def _attention_kernel_supports(target, q_latent, q_rope, latent_cache, slots, **options) -> bool:
    return (target.runs_pallas and (target.reads_float8 or not fp8.is_fp8(latent_cache.dtype))
            and attention_pallas.supports(q_latent, q_rope, latent_cache, slots, **options))


def _attention_kernel_preferred(target, q_latent, q_rope, latent_cache, slots, **options) -> bool:
    """The kernel where its programs (tokens x head blocks x its default splits) fill at least half of
    the GPU's SMs, else the tiled jnp path, which measured faster than a kernel leaving the GPU idle:
    one decode token in one program per head block took 101 us against 26 us tiled
    (benchmarks/results/2026-12-02-h200-r2/mla_check.json). With its splits the kernel fills the SMs
    at DeepSeek's shape at every step: one decode token 11.7 us against 28.3 us tiled, 32 tokens
    129 against 321 us, an 8192-token prefill 18.4 against 77.9 ms
    (benchmarks/results/2026-12-03-h200-r2/mla_check.json)."""
    if target.interpret:
        return True
    return 2 * attention_pallas.programs(q_latent, q_rope, latent_cache, slots, sms=target.sms) >= target.sms


write_index_keys_op = Op("sparse_mla.write_index_keys", reference.write_index_keys)
indexer_select_op = Op("sparse_mla.indexer_select", reference.indexer_select, (
    Implementation("triton", indexer_pallas.indexer_select, _indexer_kernel_supports),
    Implementation("tiled", tiled.indexer_select, _any_call, pallas=False),
))
sparse_mla_attention_op = Op("sparse_mla.sparse_mla_attention", reference.sparse_mla_attention, (
    Implementation("triton", attention_pallas.sparse_mla_attention, _attention_kernel_supports,
                   preferred=_attention_kernel_preferred),
    Implementation("tiled", tiled.sparse_mla_attention, _any_call, pallas=False),
))


def write_index_keys(cache, keys, slot_mapping, **cache_scale):
    """The step's indexer keys [T, D] into their rows of the side cache -> the cache."""
    return write_index_keys_op(cache, keys, slot_mapping, **cache_scale)


def indexer_select(q, weights, index_cache, positions, token_seq_ids, block_tables, *, scale, top_k: int,
                   **cache_scale):
    """Each token's ``top_k`` best cached keys of its sequence (up to its position) as cache slots
    ``[T, top_k]``, best first, -1 for none; see the reference."""
    return indexer_select_op(q, weights, index_cache, positions, token_seq_ids, block_tables, scale=scale,
                             top_k=top_k, **cache_scale)


def sparse_mla_attention(q_latent, q_rope, latent_cache, slots, *, scale, **options):
    """Absorbed-form MLA over each token's selected latent rows -> [T, H, R] (``options``: an fp8
    cache's ``cache_scale``, per-head ``sinks``); see the reference."""
    return sparse_mla_attention_op(q_latent, q_rope, latent_cache, slots, scale=scale, **options)


__all__ = ["indexer_select", "sparse_mla_attention", "write_index_keys"]
