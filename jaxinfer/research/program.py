"""The compiled research forward: one padded batch (``jaxinfer.research.batch``) through the model with
the requested recording collections mutable, returning flat arrays over the padded token rows.

A program is made per (kernel selection, capture request, outputs) and compiled by ``jax.jit`` per
bucket shape. Its outputs (float captures in float32):

* ``logits [T, V]`` float32; ``logprobs [T]``: row ``t``'s log-probability of token ``t + 1``;
* ``hidden_states [L + 1, T, hidden]``: the layers' input, layers 0..L-2's outputs, the final norm's
  output (HF's ``output_hidden_states``: the last layer's own output is replaced by the normed one);
* ``"<capture>/<layer>"`` for per-layer captures, as the layer recorded them (``capture.py``);
* ``"recurrent_states/<layer>/<array>"``: a state-slot array of the final caches, ``[S, ...]``, in HF's
  layout (a mixer whose cache keeps another says how to convert: ``states_as_hf``).

Only what is returned is computed: XLA drops the records of layers that were not asked for. The
implementations the ops took are kept per bucket when a program is traced (``Program.served``), so a
forward's memory can be estimated after tracing, before anything is allocated (``memory.py``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

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


def _hf_states(mixer, config, specs, cache: dict) -> dict:
    """A layer's state-slot arrays of ``cache``, in HF's layout where its mixer keeps another."""
    states = {array: cache[array] for spec in specs if isinstance(spec, StateSlots) for array, *_ in spec.states}
    as_hf = getattr(mixer, "states_as_hf", None)
    return as_hf(config, states) if as_hf is not None else states


@dataclasses.dataclass(frozen=True)
class Program:
    """A research forward: ``jitted(params, token_ids [T], num_new [S], block_tables [S, P],
    state_slots [S]) -> outputs``, and ``served[(T, S, P)]``: op name -> the implementations that
    served it in that bucket, recorded when it was traced."""

    jitted: Callable
    served: dict

    def __call__(self, *args):
        return self.jitted(*args)

    def implementations(self, *args) -> dict[str, set[str]]:
        """What served each op for these inputs' bucket: traced (no array is allocated) unless it was."""
        self.jitted.trace(*args)  # kept by jax.jit: the call that follows does not trace again
        return self.served[_bucket(args[1], args[3])]


def _bucket(token_ids, block_tables) -> tuple[int, int, int]:
    return (token_ids.shape[0], *block_tables.shape)


def make_program(loaded, chosen: kernel_registry.Selection, request: CaptureRequest, *, logits: bool = True,
                 logprobs: bool = False) -> Program:
    """The research ``Program`` of ``loaded`` (a ``LoadedModel``) for ``request``."""
    model, dtype = loaded.model, loaded.dtype
    layer_specs = loaded.model_cls.cache_specs(loaded.config)
    mixers = ([layer.mixer for layer in loaded.model_cls.spec(loaded.config).layers]
              if request.layers_of("recurrent_states") else [])
    collections = list(request.collections)
    served = {}

    def run(params, token_ids, num_new, block_tables, state_slots):
        num_seqs, pages_per_seq = block_tables.shape
        # Every data-parallel rank runs the whole batch in its own part of the cache.
        ranks = loaded.plan.data_parallel
        layout = CacheLayout(layer_specs, PAGE_SIZE, ranks * num_seqs * pages_per_seq, dtype,
                             num_slots=ranks * num_seqs)
        md = build_metadata(jnp.zeros_like(num_new), num_new, block_tables, page_size=PAGE_SIZE,
                            num_tokens=token_ids.shape[0], state_slots=state_slots, xp=jnp)
        def forward(params, token_ids, md, caches):
            result = model.apply({"params": params}, token_ids, md, caches, all_logits=True,
                                 mutable=collections or False)
            (out_logits, caches), variables = result if collections else (result, {})
            return (out_logits, variables), caches

        cache_specs = layout.partition_specs(loaded.plan)
        with kernel_registry.applied(chosen), kernel_registry.recording() as ops:
            (out_logits, variables), caches = loaded.per_device(forward, cache_specs)(
                params, token_ids, md, layout.zeros())
        served[_bucket(token_ids, block_tables)] = ops
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
                    for array, value in _hf_states(mixers[layer], loaded.config, layer_specs[layer],
                                                   caches[layer]).items():
                        out[f"{name}/{layer}/{array}"] = _as_float32(value)
                    continue
                key = (collection, layer, recorded_name)
                if key not in records:
                    raise RuntimeError(f"layer {layer} recorded no {recorded_name!r} in {collection!r}: its module "
                                       "does not record what its spec declares")
                (value,) = records[key]
                out[f"{name}/{layer}"] = _as_float32(value)
        return out

    return Program(jax.jit(run), served)


__all__ = ["Program", "make_program"]
