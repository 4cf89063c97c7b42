"""The memory a research forward may need, estimated from its bucket shapes before it runs, and the
refusal of one that cannot fit in the memory available (``jaxinfer.engine.memory``).

With ``T`` token rows, ``S`` sequences and ``K`` key positions per sequence, all padded, in float32
bytes, the estimate sums:

* the largest layer's ``[T, K]`` arrays: where its attention takes the plain-jnp path (as recorded
  when the program was traced) or its probabilities are captured, every token row gathers and masks
  its sequence's cache rows (``T * K *`` K's width plus twice V's, or twice MLA's latent row, or
  the indexer's keys) and holds scores and probabilities (``2 * T * heads * K``); a query-tiled
  indexer holds two tiles at most, a kernel none of these;
* the caches the forward builds (``S * K`` rows of every layer, the state slots), twice;
* activations, ``32 * T *`` the widest projection; the logits ``[T, vocab]``, their log-softmax
  and their host copy; the captures three times (recorded, returned, copied to the host);
* 64 MiB for everything small.

Parameters are resident already. It is an upper bound of the right order: for the tiny models'
compiled forwards of 1,000 to 4,000 tokens, XLA's own analysis counts 1.3 to 5 times less.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.cache.layout import CacheLayout
from jaxinfer.cache.specs import PagedKV, PagedLatent, PagedSide
from jaxinfer.engine.memory import available_bytes
from jaxinfer.errors import InvalidRequestError
from jaxinfer.kernels.sparse_mla.tiled import TILE_BYTES
from jaxinfer.models.layers.moe import MoESpec
from jaxinfer.research.batch import Batch

F32 = 4
ACTIVATION_ROWS = 32  # [T, width] float32 arrays counted alive at once
SMALL_BYTES = 64 << 20

# The op that reads a paged cache kind over whole sequences in a forward.
_READER = {PagedKV: "attention.ragged_paged_attention", PagedLatent: "mla.mla_ragged_paged_attention",
           PagedSide: "sparse_mla.indexer_select"}


def _layer_temporaries(specs, mixer, heads: int, batch: Batch, served: dict, captured: bool, top_k: int) -> int:
    """Bytes of the ``[T, K]`` arrays one layer may hold at once (0 for a linear-attention layer)."""
    rows = batch.num_tokens * batch.num_keys
    sparse = getattr(mixer, "indexer", None) is not None or getattr(mixer, "shares_selection", False)
    size = 0
    for spec in specs:
        op = _READER.get(type(spec))
        if op is None:
            continue
        width = spec.bytes_per_token(np.float32) // F32
        chosen = served.get(op, {"reference"})
        if isinstance(spec, PagedSide):  # the indexer's keys, per-head scores and summed scores
            indexer = getattr(mixer, "indexer", None)
            term = rows * F32 * (width + (indexer.num_heads if indexer is not None else heads) + 2)
            size += term if "reference" in chosen else min(term, 2 * TILE_BYTES) if "tiled" in chosen else 0
            continue
        # Gathered rows and their masked copies: K once and V twice (width 2 kv_heads x head_dim); MLA's
        # latent row twice.
        gathered = 3 * width // 2 if isinstance(spec, PagedKV) else 2 * width
        term = rows * F32 * (gathered + 2 * heads)
        size += term * (int(not sparse and "reference" in chosen) + int(captured))
        if captured and sparse:  # the capture matches each key row against the selection: [T, K, top_k]
            size += rows * top_k
    return size


def _widest(config, layers) -> int:
    widths = [config.hidden_size, getattr(config, "intermediate_size", None) or 0,
              config.num_attention_heads * (getattr(config, "head_dim", None) or 0)]
    widths += [layer.ffn.top_k * max(layer.ffn.intermediate_size, config.hidden_size)
               for layer in layers if isinstance(layer.ffn, MoESpec)]
    return max(widths)


def _captures(config, request, layers, layer_specs, batch: Batch, top_k: int) -> int:
    t, s = batch.num_tokens, len(batch.num_new)
    size = (config.num_hidden_layers + 1) * t * config.hidden_size * F32 if request.hidden_states else 0
    for name, chosen in request.layers:
        for i in chosen:
            if name == "attentions":
                size += t * config.num_attention_heads * batch.num_keys * F32
            elif name == "router_logits":
                size += t * layers[i].ffn.num_experts * F32
            elif name in ("selected_experts", "routing_weights"):
                size += t * layers[i].ffn.top_k * F32
            elif name == "indexer_selections":
                size += t * top_k * F32
            elif name == "recurrent_states":  # in float32
                size += s * sum(spec.bytes_per_sequence(np.float32) for spec in layer_specs[i])
    return size


def estimate(loaded, request, batch: Batch, served: dict, *, logits: bool, logprobs: bool) -> tuple[int, int]:
    """-> (an upper bound of the bytes a forward over ``batch`` allocates, the part of it that is the
    largest layer's ``[T, K]`` temporaries); see the module docstring. ``served``: op name -> the
    implementations its trace chose (``Program.implementations``)."""
    config, dtype = loaded.config, np.dtype(loaded.dtype)
    layer_specs = loaded.model_cls.cache_specs(config)
    layers = loaded.model_cls.spec(config).layers if hasattr(loaded.model_cls, "spec") else ()
    mixers = [layer.mixer for layer in layers] or [None] * len(layer_specs)
    top_k = max((m.indexer.top_k for m in mixers if getattr(m, "indexer", None) is not None), default=0)
    t, s, keys = batch.num_tokens, len(batch.num_new), batch.num_keys
    captured = set(request.layers_of("attentions"))
    attention = max((_layer_temporaries(specs, mixer, config.num_attention_heads, batch, served, i in captured, top_k)
                     for i, (specs, mixer) in enumerate(zip(layer_specs, mixers))), default=0)
    caches = 2 * s * (keys * CacheLayout.bytes_per_token_for(layer_specs, dtype)
                      + CacheLayout.bytes_per_sequence_for(layer_specs, dtype))
    activations = ACTIVATION_ROWS * t * _widest(config, layers) * F32
    logit_bytes = (2 + int(logits)) * t * config.vocab_size * F32 + (t * F32 if logprobs else 0)
    captures = 3 * _captures(config, request, layers, layer_specs, batch, top_k)
    return attention + caches + activations + logit_bytes + captures + SMALL_BYTES, attention


def _gib(size: int) -> str:
    return f"{size / (1 << 30):.1f} GiB"


def check_fits(loaded, request, batch: Batch, served: dict, *, logits: bool, logprobs: bool) -> None:
    """Refuse (``InvalidRequestError``) a forward whose estimate exceeds the memory available on the
    model's first device; nothing is checked where that is unknown."""
    device = loaded.mesh.devices.flat[0]
    available = available_bytes(device)
    if available is None:
        return
    need, attention = estimate(loaded, request, batch, served, logits=logits, logprobs=logprobs)
    if need <= available:
        return
    most = f"; {_gib(attention)} of it one layer's attention arrays over token rows x keys" \
        if 2 * attention > need else ""
    raise InvalidRequestError(
        f"a research forward over {sum(batch.lengths)} tokens in {len(batch.lengths)} sequence(s) (padded to "
        f"{batch.num_tokens} token rows x {batch.num_keys} keys) would need about {_gib(need)} (an upper bound{most}), "
        f"more than the {_gib(available)} available on the {device.platform.upper()}: give shorter sequences, or "
        "fewer sequences per call")


__all__ = ["check_fits", "estimate"]
