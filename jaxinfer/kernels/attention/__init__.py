"""Attention ops over the paged KV cache.

Models call these functions; each dispatches to an implementation chosen by platform. Today every
platform runs the plain-jnp reference (``reference.py``); GPU kernels register here behind the same
signatures. ``set_implementation("reference")`` forces the reference everywhere (for debugging).
"""

from __future__ import annotations

import jax

from jaxinfer.kernels.attention import reference

_IMPLEMENTATIONS = {
    "reference": {
        "write_kv_cache": reference.write_kv_cache,
        "ragged_paged_attention": reference.ragged_paged_attention,
        "paged_decode_attention": reference.paged_decode_attention,
    },
}
_PLATFORM_DEFAULT = {"cpu": "reference", "gpu": "reference", "cuda": "reference", "tpu": "reference"}
_forced: str | None = None


def set_implementation(name: str | None) -> None:
    """Force one implementation (``None`` goes back to the per-platform default)."""
    if name is not None and name not in _IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {name!r}; known: {sorted(_IMPLEMENTATIONS)}")
    global _forced
    _forced = name


def _impl(op: str):
    name = _forced or _PLATFORM_DEFAULT.get(jax.default_backend(), "reference")
    return _IMPLEMENTATIONS[name][op]


def write_kv_cache(k_cache, v_cache, k, v, slot_mapping):
    return _impl("write_kv_cache")(k_cache, v_cache, k, v, slot_mapping)


def ragged_paged_attention(q, k_cache, v_cache, md, **options):
    return _impl("ragged_paged_attention")(q, k_cache, v_cache, md, **options)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, **options):
    return _impl("paged_decode_attention")(q, k_cache, v_cache, block_tables, seq_lens, **options)
