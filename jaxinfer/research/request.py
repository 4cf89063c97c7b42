"""What a research forward may capture, which layers can give it, and the checked request.

``capture`` is a name, a list of names, or ``{name: layers}`` (``None``: every layer that has it; an
int or a list of ints: those layers). Each layer's captures follow from its spec: attention
probabilities from softmax-attention mixers (GQA, MLA, sparse MLA), indexer selections from
sparse-attention layers with their own indexer, recurrent states from mixers that keep a
per-sequence state (``StateSlots``), routing from MoE feed-forwards. Anything else is an
``InvalidRequestError`` that names the layer and the layers that have it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from jaxinfer import checks
from jaxinfer.cache.specs import StateSlots
from jaxinfer.errors import InvalidRequestError
from jaxinfer.models.layers import capture as recorded
from jaxinfer.models.layers.moe import MoESpec

# capture name -> (what gives it, the collection its layers record into and the recorded name; None:
# read from the forward's final caches)
CAPTURES = {
    "hidden_states": ("every layer", recorded.HIDDEN_STATES, None),
    "attentions": ("a softmax-attention layer", recorded.ATTENTIONS, "probs"),
    "router_logits": ("an MoE layer", recorded.ROUTING, "router_logits"),
    "selected_experts": ("an MoE layer", recorded.ROUTING, "selected_experts"),
    "routing_weights": ("an MoE layer", recorded.ROUTING, "routing_weights"),
    "indexer_selections": ("a sparse-attention layer with its own indexer", recorded.INDEXER, "selected_slots"),
    "recurrent_states": ("a linear-attention layer (a per-sequence recurrent state)", None, None),
}
_ROUTING = ("router_logits", "selected_experts", "routing_weights")


def layer_captures(layers, config) -> tuple[frozenset[str], ...]:
    """The per-layer capture names each ``LayerSpec`` of ``layers`` can give."""
    out = []
    for layer in layers:
        mixer = getattr(layer.mixer, "captures", ())
        names = {name for name, (_, collection, _) in CAPTURES.items()
                 if collection is not None and collection in mixer}
        if any(isinstance(spec, StateSlots) for spec in layer.mixer.cache_specs(config)):
            names.add("recurrent_states")
        if isinstance(layer.ffn, MoESpec):
            names.update(_ROUTING)
        out.append(frozenset(names))
    return tuple(out)


def describe_layer(layer) -> str:
    """E.g. ``GatedDeltaNet + MoE``, ``MLA (sharing the previous indexer's selection) + MoE``."""
    mixer = type(layer.mixer).__name__
    if getattr(layer.mixer, "indexer", None) is not None:
        mixer += " (with a sparse-attention indexer)"
    elif getattr(layer.mixer, "shares_selection", False):
        mixer += " (sharing the previous indexer's selection)"
    return f"{mixer} + {'MoE' if isinstance(layer.ffn, MoESpec) else 'dense MLP'}"


@dataclasses.dataclass(frozen=True)
class CaptureRequest:
    """``hidden_states``: whether asked; ``layers``: per-layer capture name -> the layers asked."""

    hidden_states: bool = False
    layers: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @property
    def collections(self) -> tuple[str, ...]:
        """The recording collections the forward must make mutable."""
        wanted = {CAPTURES[name][1] for name, _ in self.layers}
        if self.hidden_states:
            wanted.add(recorded.HIDDEN_STATES)
        return tuple(sorted(c for c in wanted if c is not None))

    def layers_of(self, name: str) -> tuple[int, ...]:
        return dict(self.layers).get(name, ())

    @property
    def names(self) -> tuple[str, ...]:
        return (("hidden_states",) if self.hidden_states else ()) + tuple(name for name, _ in self.layers)


def _names_and_layers(capture) -> list[tuple[str, object]]:
    if capture is None:
        return []
    if isinstance(capture, str):
        return [(capture, None)]
    if isinstance(capture, Mapping):
        return list(capture.items())
    if isinstance(capture, Iterable) and not isinstance(capture, bytes):
        return [(name, None) for name in capture]
    raise InvalidRequestError(f"capture must be a name, a list of names or {{name: layers}}, got "
                              f"{type(capture).__name__}; names: {', '.join(CAPTURES)}")


def _layer_list(name: str, layers, num_layers: int) -> list[int]:
    if checks.is_integer(layers):
        layers = [layers]
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise InvalidRequestError(f"capture {name!r}: layers must be None (all), a layer index or a list of them, "
                                  f"got {layers!r}")
    layers = list(layers)
    wrong = [i for i in layers if not checks.is_integer(i)]
    if wrong:
        raise InvalidRequestError(f"capture {name!r}: layer indices must be integers, got {wrong!r}")
    out = [int(i) for i in layers]
    outside = [i for i in out if not 0 <= i < num_layers]
    if outside:
        raise InvalidRequestError(f"capture {name!r}: layers {outside} are out of range; the model has {num_layers} "
                                  f"layers (0-{num_layers - 1})")
    if not out:
        raise InvalidRequestError(f"capture {name!r}: the layer list is empty; give None for every layer that has it")
    return sorted(set(out))


def parse(capture, layers, config) -> CaptureRequest:
    """The checked request for the decoder ``layers`` (``LayerSpec``s) of ``config``."""
    available = layer_captures(layers, config)
    hidden_states, per_layer = False, {}
    for name, asked in _names_and_layers(capture):
        if not isinstance(name, str) or name not in CAPTURES:
            raise InvalidRequestError(f"unknown capture {name!r}; known: {', '.join(CAPTURES)}")
        if name == "hidden_states":
            if asked is not None:
                raise InvalidRequestError("capture 'hidden_states' takes no layers: every layer's are returned, as "
                                          "HF's output_hidden_states returns them (embeddings first, the final norm's "
                                          "output last)")
            hidden_states = True
            continue
        having = [i for i, names in enumerate(available) if name in names]
        what = CAPTURES[name][0]
        if not having:
            kinds = ", ".join(f"{i}: {describe_layer(layer)}" for i, layer in enumerate(layers))
            raise InvalidRequestError(f"capture {name!r} comes from {what}, and this {config.model_type} model has "
                                      f"none (layers {kinds})")
        if asked is None:
            per_layer[name] = tuple(having)
            continue
        chosen = _layer_list(name, asked, len(layers))
        missing = [i for i in chosen if i not in having]
        if missing:
            i = missing[0]
            raise InvalidRequestError(f"capture {name!r} comes from {what}; layer {i} is {describe_layer(layers[i])}, "
                                      f"which has none; layers that have it: {having}")
        per_layer[name] = tuple(chosen)
    return CaptureRequest(hidden_states, tuple(sorted(per_layer.items())))


__all__ = ["CAPTURES", "CaptureRequest", "describe_layer", "layer_captures", "parse"]
