"""The compiled research forward: one padded batch (``jaxinfer.research.batch``) through the model with
the requested recording collections mutable, returning flat arrays over the padded token rows.

A program is made per (kernel selection, capture request, outputs) and compiled by ``jax.jit`` per
bucket shape. Its outputs (float captures in float32):

* ``logits [T, V]`` float32; ``logprobs [T]``: row ``t``'s log-probability of token ``t + 1``;
* ``hidden_states [L + 1, T, hidden]``: the layers' input, layers 0..L-2's outputs, the final norm's
  output (HF's ``output_hidden_states``: the last layer's own output is replaced by the normed one);
* ``"<capture>/<layer>"`` for per-layer captures, as the layer recorded them (``capture.py``);
* ``"recurrent_states/<layer>/<array>"``: a state-slot array of the final caches, ``[S, ...]``.

Only what is returned is computed: XLA drops the records of layers that were not asked for.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from flax import traverse_util

from jaxinfer.cache.layout import CacheLayout
from jaxinfer.cache.metadata import build_metadata
from jaxinfer.cache.specs import StateSlots
from jaxinfer.kernels import registry as kernel_registry
from jaxinfer.models.layers import capture as recorded
from jaxinfer.research.batch import PAGE_SIZE
from jaxinfer.research.request import CAPTURES, CaptureRequest

_LAYER = re.compile(r"^layers_(\d+)$")


def _as_float32(x):
    return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x


def _records(variables) -> dict[tuple[str, int | None, str], object]:
    """{(collection, layer index or None, recorded name): values} of ``apply``'s mutated collections."""
    out = {}
    for path, values in traverse_util.flatten_dict(dict(variables)).items():
        layer = next((int(m.group(1)) for m in map(_LAYER.match, path) if m), None)
        out[(path[0], layer, path[-1])] = values
    return out


def _hidden_states(records):
    (embeddings,) = records[(recorded.HIDDEN_STATES, None, "embeddings")]
    outputs = records[(recorded.HIDDEN_STATES, None, "layer_outputs")]
    (final,) = records[(recorded.HIDDEN_STATES, None, "final")]
    return jnp.stack([_as_float32(x) for x in (embeddings, *outputs[:-1], final)])


def make_program(loaded, chosen: kernel_registry.Selection, request: CaptureRequest, *, logits: bool = True,
                 logprobs: bool = False):
    """The jitted ``(params, token_ids [T], num_new [S], block_tables [S, P], state_slots [S]) ->
    outputs`` of ``loaded`` (a ``LoadedModel``) for ``request``."""
    model, config, dtype = loaded.model, loaded.config, loaded.dtype
    layer_specs = loaded.model_cls.cache_specs(config)
    collections = list(request.collections)

    def run(params, token_ids, num_new, block_tables, state_slots):
        num_seqs, pages_per_seq = block_tables.shape
        layout = CacheLayout(layer_specs, PAGE_SIZE, num_seqs * pages_per_seq, dtype, num_slots=num_seqs)
        md = build_metadata(jnp.zeros_like(num_new), num_new, block_tables, page_size=PAGE_SIZE,
                            num_tokens=token_ids.shape[0], state_slots=state_slots, xp=jnp)
        with kernel_registry.applied(chosen):
            result = model.apply({"params": params}, token_ids, md, layout.zeros(), all_logits=True,
                                 mutable=collections or False)
        (out_logits, caches), variables = result if collections else (result, {})
        records = _records(variables)
        out = {}
        if logits:
            out["logits"] = out_logits
        if logprobs:
            log_probs = jax.nn.log_softmax(out_logits, axis=-1)
            following = jnp.roll(token_ids, -1)
            out["logprobs"] = jnp.take_along_axis(log_probs, following[:, None], axis=-1)[:, 0]
        if request.hidden_states:
            out["hidden_states"] = _hidden_states(records)
        for name, layers in request.layers:
            _, collection, recorded_name = CAPTURES[name]
            for layer in layers:
                if collection is None:  # recurrent states: the layer's state-slot arrays after the forward
                    for spec in layer_specs[layer]:
                        if isinstance(spec, StateSlots):
                            for array, _, _ in spec.states:
                                out[f"{name}/{layer}/{array}"] = _as_float32(caches[layer][array])
                    continue
                key = (collection, layer, recorded_name)
                if key not in records:
                    raise RuntimeError(f"layer {layer} recorded no {recorded_name!r} in {collection!r}: its module "
                                       "does not record what its spec declares")
                (value,) = records[key]
                out[f"{name}/{layer}"] = _as_float32(value)
        return out

    return jax.jit(run)


__all__ = ["make_program"]
