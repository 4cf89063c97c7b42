"""Attention ops over the paged KV cache.

Implementations (chosen by ``jaxinfer.kernels.registry``): the plain-jnp reference
(``reference.py``, the semantic truth); the Pallas Triton-lowered kernels (``rotary_pallas.py``: the
q/k norm, RoPE and cache write in one launch; ``decode_pallas.py``: split-KV decode attention, also
fused with that step; ``prefill_pallas.py``: ragged prefill); and, on Hopper, the warp-specialised
Mosaic GPU prefill (``prefill_mgpu.py``) where its ``supports`` takes the call. A bare cache write
stays an XLA scatter (with the caches donated it updates in place).

The ragged op takes the step's named arrays: token ``t`` of sequence ``token_seq_ids[t]`` (-1:
padding, which gets zeros) at ``positions[t]``; sequence ``s`` holds ``seq_lens[s]`` tokens in the
pages ``block_tables[s]``.

An fp8 cache (``kv_cache_dtype="fp8"``) comes with its scales: every op then takes ``k_scale`` and
``v_scale`` (float32 scalars; ``jaxinfer.cache.fp8``). The rotary cache write and the decode kernels
(fused or not) write and read e4m3 themselves, and so does the Triton prefill kernel where Pallas
reads e4m3 (``Target.reads_float8``); the Mosaic GPU prefill kernel refuses fp8 caches (the Triton
kernel, else the reference, serves them).
"""

from __future__ import annotations

from jaxinfer.cache import fp8
from jaxinfer.kernels.attention import decode_pallas, prefill_mgpu, prefill_pallas, reference, rotary_pallas
from jaxinfer.kernels.registry import Implementation, Op, Target


def _mgpu_prefill_supports(target: Target, q, k_cache, v_cache, positions, token_seq_ids, block_tables, seq_lens, *,
                           scale, **options) -> bool:
    return (target.hopper and set(options) <= {"sliding_window", "logit_softcap", "sinks"}
            and prefill_mgpu.supports(q, k_cache, **options))


def _triton_prefill_supports(target: Target, q, k_cache, v_cache, *args, **options) -> bool:
    return (target.runs_pallas and prefill_pallas.supports(q, k_cache, v_cache, *args, **options)
            and (target.reads_float8 or not fp8.is_fp8(k_cache.dtype)))


def _pallas_reading_cache(cache_at: int):
    """A kernel's ``supports``: Pallas runs here, and an fp8 cache (the call's argument ``cache_at``)
    only where Pallas reads e4m3 (``Target.reads_float8``)."""
    def supports(target: Target, *args, **options) -> bool:
        return target.runs_pallas and (target.reads_float8 or not fp8.is_fp8(args[cache_at].dtype))
    return supports


def _mgpu_prefill(q, k_cache, v_cache, positions, token_seq_ids, block_tables, seq_lens, *, scale, **options):
    return prefill_mgpu.ragged_paged_attention(q, k_cache, v_cache, positions, token_seq_ids, block_tables, seq_lens,
                                               scale=scale)


write_kv_cache_op = Op("attention.write_kv_cache", reference.write_kv_cache)
rotary_cache_write_op = Op("attention.rotary_cache_write", reference.rotary_cache_write, (
    Implementation("rotary", rotary_pallas.rotary_cache_write, _pallas_reading_cache(5)),
))
ragged_paged_attention_op = Op("attention.ragged_paged_attention", reference.ragged_paged_attention, (
    Implementation("mgpu", _mgpu_prefill, _mgpu_prefill_supports, pallas=False),
    Implementation("triton", prefill_pallas.ragged_paged_attention, _triton_prefill_supports),
))
paged_decode_attention_op = Op("attention.paged_decode_attention", reference.paged_decode_attention, (
    Implementation("triton", decode_pallas.paged_decode_attention, _pallas_reading_cache(1)),
))
rotary_paged_decode_attention_op = Op("attention.rotary_paged_decode_attention",
                                      reference.rotary_paged_decode_attention, (
    Implementation("triton", decode_pallas.rotary_paged_decode_attention, _pallas_reading_cache(5)),
))


def write_kv_cache(k_cache, v_cache, k, v, slot_mapping, **scales):
    """New K/V rows [T, kv_heads, d] into their slots (negative: dropped) -> (k_cache, v_cache)."""
    return write_kv_cache_op(k_cache, v_cache, k, v, slot_mapping, **scales)


def rotary_cache_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, **options):
    """The optional q/k norm, RoPE, then k/v into the cache -> (q, k_cache, v_cache); see the reference."""
    return rotary_cache_write_op(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, **options)


def ragged_paged_attention(q, k_cache, v_cache, positions, token_seq_ids, block_tables, seq_lens, **options):
    """Queries [T, heads, d] of several sequences (any number of new tokens each) over the cache."""
    return ragged_paged_attention_op(q, k_cache, v_cache, positions, token_seq_ids, block_tables, seq_lens, **options)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, **options):
    """One query per sequence [S, heads, d], at position ``seq_lens[s] - 1``."""
    return paged_decode_attention_op(q, k_cache, v_cache, block_tables, seq_lens, **options)


def rotary_paged_decode_attention(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                                  **options):
    """A decode step from the projections on: ``rotary_cache_write`` then ``paged_decode_attention``
    -> (out, k_cache, v_cache)."""
    return rotary_paged_decode_attention_op(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, block_tables,
                                            seq_lens, **options)


__all__ = ["paged_decode_attention", "ragged_paged_attention", "rotary_cache_write", "rotary_paged_decode_attention",
           "write_kv_cache"]
