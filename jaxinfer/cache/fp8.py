"""An fp8 (e4m3) KV cache: the option that asks for it, and how values go in and out.

``kv_cache_dtype="fp8"`` (vLLM's option; alias ``"fp8_e4m3"``) stores every paged cache array in
float8_e4m3fn with one float32 scale per array of a layer (``<array>_scale`` beside it in the layer's
cache). A write stores ``clip(x / scale, -448, 448)`` cast to e4m3; a read is ``value.astype(f32) *
scale``, after which attention computes as with a cache in the compute dtype. ``"auto"`` keeps the
cache in the compute dtype, with no scales. State slots (linear-attention state) keep their dtype.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxinfer.errors import ConfigError

FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
KV_CACHE_DTYPES = {"auto": None, "fp8": FP8, "fp8_e4m3": FP8}


def kv_cache_dtype(name) -> np.dtype | None:
    """The paged arrays' dtype ``name`` asks for (None: the compute dtype); ``ConfigError`` for
    anything but a name of ``KV_CACHE_DTYPES``."""
    if not isinstance(name, str) or name not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} ('auto': the compute dtype; "
                          f"'fp8': float8_e4m3fn with a per-layer scale), got {name!r}")
    return KV_CACHE_DTYPES[name]


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) == FP8


def scale_name(array: str) -> str:
    """The name of an fp8 cache array's scale in the layer's cache."""
    return f"{array}_scale"


def scales_of(cache: dict, *arrays: str) -> tuple:
    """The scales of ``arrays`` in a layer's ``cache`` (None for an array that is not fp8)."""
    return tuple(cache.get(scale_name(name)) for name in arrays)


def check_scale(cache, scale, what: str) -> None:
    """``ValueError`` unless an fp8 ``cache`` comes with its ``scale`` and any other cache without one."""
    if is_fp8(cache.dtype) and scale is None:
        raise ValueError(f"the fp8 {what} cache needs its scale")
    if not is_fp8(cache.dtype) and scale is not None:
        raise ValueError(f"a scale is given for the {what} cache, which is {jnp.dtype(cache.dtype).name}, not fp8")


def quantize(x, dtype, scale=None):
    """``x`` as stored in a cache of ``dtype``: ``clip(x / scale, -448, 448)`` in e4m3 for fp8, else a cast."""
    if not is_fp8(dtype):
        return x.astype(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX).astype(FP8)


def dequantize(values, scale=None):
    """Cache ``values`` as the numbers they stand for: float32 ``values * scale`` for fp8, else as they are."""
    if not is_fp8(values.dtype):
        return values
    return values.astype(jnp.float32) * scale


__all__ = ["FP8", "FP8_MAX", "KV_CACHE_DTYPES", "check_scale", "dequantize", "is_fp8", "kv_cache_dtype",
           "quantize", "scale_name", "scales_of"]
