"""The KV-cache scales a checkpoint gives, for an fp8 cache (``jaxinfer.cache.fp8``).

vLLM / llm-compressor checkpoints store one float32 scalar per attention layer and side:
``model.layers.N.self_attn.k_scale`` and ``.v_scale`` (some nest them under ``k_proj`` / ``v_proj`` /
``attn``). A GQA layer's K and V caches take them; an MLA layer's latent cache (one array for its
latent and rope key) takes ``k_scale``, as vLLM's MLA does; a sparse-attention indexer's key cache
has none in any checkpoint and keeps 1.0, as does every array a checkpoint gives no scale for.
"""

from __future__ import annotations

import math
import re

import numpy as np

from jaxinfer.cache import fp8
from jaxinfer.cache.specs import PagedKV, PagedLatent
from jaxinfer.errors import CheckpointError

# The checkpoint names of KV-cache scales (the model's ``ignored_checkpoint_keys`` leave them to this module).
SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:\w+\.)*?([kv])_scale$")


def _targets(specs) -> dict[str, str]:
    """{"k" / "v": the scale array of the layer's cache it sets}, from the layer's cache specs."""
    for spec in specs:
        if isinstance(spec, PagedKV):
            return {"k": fp8.scale_name("k"), "v": fp8.scale_name("v")}
        if isinstance(spec, PagedLatent):
            return {"k": fp8.scale_name("latent")}
    return {}


def _value(checkpoint, name: str) -> float:
    shape = tuple(checkpoint.shape(name))
    if shape not in ((), (1,)):
        raise CheckpointError(f"the KV-cache scale {name} must be a scalar (shape [] or [1]), got shape {list(shape)}")
    value = float(np.asarray(checkpoint.read(name), np.float64).reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise CheckpointError(f"the KV-cache scale {name} must be a finite positive number, got {value}")
    return value


def read_kv_scales(checkpoint, layer_specs) -> tuple[tuple[tuple[str, float], ...], ...]:
    """Per layer, ``(scale array name, value)`` of each KV-cache scale ``checkpoint`` gives (the
    ``kv_scales`` of ``CacheLayout``). ``CheckpointError`` for a scale that is not a finite positive
    scalar, given twice for one layer and side, or given for a layer that keeps no attention cache."""
    found: dict[tuple[int, str], str] = {}
    for name in checkpoint.names():
        match = SCALE_NAME.search(name)
        if not match:
            continue
        key = (int(match.group(1)), match.group(2))
        if key in found:
            raise CheckpointError(f"layer {key[0]}'s {key[1]}_scale is given twice: {found[key]} and {name}")
        found[key] = name
    scales = [{} for _ in layer_specs]
    for (layer, side), name in sorted(found.items()):
        value = _value(checkpoint, name)
        targets = _targets(layer_specs[layer]) if layer < len(layer_specs) else {}
        if not targets:
            raise CheckpointError(f"{name} is a KV-cache scale for layer {layer}, which keeps no attention cache")
        if side in targets:
            scales[layer][targets[side]] = value
    return tuple(tuple(sorted(layer.items())) for layer in scales)


__all__ = ["SCALE_NAME", "read_kv_scales"]
