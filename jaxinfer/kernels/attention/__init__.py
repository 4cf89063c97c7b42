"""Attention ops over the paged KV cache.

Models call these functions; each dispatches to an implementation chosen by platform: the plain-jnp
reference (``reference.py``, the semantic truth) on CPU, the Pallas kernels on GPU. An op without a
kernel falls back to the reference. ``set_implementation("reference")`` forces the reference
everywhere (for debugging and for measuring what the kernels buy).
"""

from __future__ import annotations

import functools

import jax

from jaxinfer.kernels.attention import decode_pallas, prefill_mgpu, prefill_pallas, reference, rotary_pallas
from jaxinfer.kernels.dispatch import OpDispatcher


@functools.cache
def _on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x), which the wgmma/TMA kernel needs."""
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")


def _gpu_ragged_paged_attention(q, k_cache, v_cache, md, *, scale, interpret=False, **options):
    """The warp-specialised Mosaic GPU kernel where it takes the call on a Hopper GPU, else the
    Triton kernel (sliding window, soft-cap, sinks, float32, other GPUs, tuning options, interpret mode)."""
    if not interpret and _on_hopper() and set(options) <= {"sliding_window", "logit_softcap", "sinks"} \
            and prefill_mgpu.supports(q, k_cache, **options):
        return prefill_mgpu.ragged_paged_attention(q, k_cache, v_cache, md, scale=scale)
    return prefill_pallas.ragged_paged_attention(q, k_cache, v_cache, md, scale=scale, interpret=interpret, **options)


_dispatch = OpDispatcher(
    "attention",
    {
        "reference": {
            "write_kv_cache": reference.write_kv_cache,
            "rotary_cache_write": reference.rotary_cache_write,
            "ragged_paged_attention": reference.ragged_paged_attention,
            "paged_decode_attention": reference.paged_decode_attention,
            "rotary_paged_decode_attention": reference.rotary_paged_decode_attention,
        },
        "pallas": {
            # A bare cache write stays an XLA scatter (with the caches donated it updates in place);
            # fused with the q/k norm and RoPE before it, it is one kernel instead of about seven.
            "rotary_cache_write": rotary_pallas.rotary_cache_write,
            "paged_decode_attention": decode_pallas.paged_decode_attention,
            # At a decode step the attention programs do the q/k norm, RoPE and cache write
            # themselves: one kernel fewer per layer.
            "rotary_paged_decode_attention": decode_pallas.rotary_paged_decode_attention,
            "ragged_paged_attention": _gpu_ragged_paged_attention,
        },
    },
    {"gpu": "pallas", "cuda": "pallas"},
)
set_implementation = _dispatch.set_implementation
implementation_name = _dispatch.implementation_name


def write_kv_cache(k_cache, v_cache, k, v, slot_mapping):
    return _dispatch("write_kv_cache")(k_cache, v_cache, k, v, slot_mapping)


def rotary_cache_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, **options):
    return _dispatch("rotary_cache_write")(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, **options)


def ragged_paged_attention(q, k_cache, v_cache, md, **options):
    return _dispatch("ragged_paged_attention")(q, k_cache, v_cache, md, **options)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, **options):
    return _dispatch("paged_decode_attention")(q, k_cache, v_cache, block_tables, seq_lens, **options)


def rotary_paged_decode_attention(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                                  **options):
    """A decode step from the projections on: ``rotary_cache_write`` then ``paged_decode_attention``
    -> (out, k_cache, v_cache)."""
    return _dispatch("rotary_paged_decode_attention")(q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
                                                     block_tables, seq_lens, **options)
