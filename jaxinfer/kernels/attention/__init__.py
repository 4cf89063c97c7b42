"""Attention ops over the paged KV cache.

Models call these functions; each dispatches to an implementation chosen by platform: the plain-jnp
reference (``reference.py``, the semantic truth) on CPU, the Pallas kernels on GPU. An op without a
kernel falls back to the reference. ``set_implementation("reference")`` forces the reference
everywhere (for debugging and for measuring what the kernels buy).
"""

from __future__ import annotations

import jax

from jaxinfer.kernels.attention import decode_pallas, prefill_pallas, reference

_IMPLEMENTATIONS = {
    "reference": {
        "write_kv_cache": reference.write_kv_cache,
        "ragged_paged_attention": reference.ragged_paged_attention,
        "paged_decode_attention": reference.paged_decode_attention,
    },
    "pallas": {
        # The cache write stays an XLA scatter: with the caches donated it updates in place.
        "paged_decode_attention": decode_pallas.paged_decode_attention,
        "ragged_paged_attention": prefill_pallas.ragged_paged_attention,
    },
}
_PLATFORM_DEFAULT = {"cpu": "reference", "gpu": "pallas", "cuda": "pallas", "rocm": "reference", "tpu": "reference"}
_forced: str | None = None


def set_implementation(name: str | None) -> None:
    """Force one implementation (``None`` goes back to the per-platform default)."""
    if name is not None and name not in _IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {name!r}; known: {sorted(_IMPLEMENTATIONS)}")
    global _forced
    _forced = name


def implementation_name() -> str:
    return _forced or _PLATFORM_DEFAULT.get(jax.default_backend(), "reference")


def _impl(op: str):
    return _IMPLEMENTATIONS[implementation_name()].get(op, _IMPLEMENTATIONS["reference"][op])


def write_kv_cache(k_cache, v_cache, k, v, slot_mapping):
    return _impl("write_kv_cache")(k_cache, v_cache, k, v, slot_mapping)


def ragged_paged_attention(q, k_cache, v_cache, md, **options):
    return _impl("ragged_paged_attention")(q, k_cache, v_cache, md, **options)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, **options):
    return _impl("paged_decode_attention")(q, k_cache, v_cache, block_tables, seq_lens, **options)
