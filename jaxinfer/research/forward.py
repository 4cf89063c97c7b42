"""The research forward of a ``LoadedModel``: sequences in, per-sequence unpadded results out.

``forward`` packs the sequences into bucketed shapes (``batch.py``), runs the program for the kernel
selection in force and the capture request (``program.py``; a program and its compiled buckets are
kept on the model) unless its memory estimate exceeds what is available (``memory.py``), and cuts
each sequence's rows out of the padded outputs (``ForwardResult``).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxinfer.errors import InvalidRequestError
from jaxinfer.kernels import registry as kernel_registry
from jaxinfer.research import memory
from jaxinfer.research import request as requests
from jaxinfer.research.batch import Batch, pack
from jaxinfer.research.program import make_program

# Attention probabilities are materialised ([token rows, heads, keys] per layer, float32): a forward
# computes at most this many bytes of them, over all the layers asked for.
MAX_ATTENTION_BYTES = 1 << 28


@dataclasses.dataclass(frozen=True)
class ForwardResult:
    """One sequence's results (numpy; float captures in float32). Per-layer captures are dicts keyed
    by layer index; a capture that was not asked for is None.

    * ``logits [n, vocab]``; ``hidden_states``: ``num_layers + 1`` arrays ``[n, hidden]``, HF's
      ``output_hidden_states``: the embeddings (as the first layer sees them), each layer's output,
      and last the final norm's output in place of the last layer's own;
    * ``attentions[layer] [heads, n, n]``: softmax probabilities (query, key), HF's
      ``output_attentions`` with eager attention (sinks dropped, so rows may sum to less than 1);
    * ``router_logits[layer] [n, experts]`` (the router projection, before any softmax / sigmoid,
      HF's ``output_router_logits``), ``selected_experts[layer] [n, top_k]`` int32 and
      ``routing_weights[layer] [n, top_k]`` (the weights the experts' outputs are summed with), in the
      router's top-k order;
    * ``indexer_selections[layer] [n, index_topk]`` int32: the key positions each token's sparse
      attention reads, best first, -1 where the token sees fewer keys than ``index_topk`` (layers
      with their own indexer; a GLM-5 "shared" layer reads the selection of the indexer before it);
    * ``recurrent_states[layer]``: the layer's state after the sequence, ``{"recurrent_state":
      [heads, key_dim, value_dim], "conv_state": [conv_kernel - 1, channels]}`` (the short
      convolution's last inputs; HF's cache keeps the last ``conv_kernel``, channels first; lightning
      layers have no conv), as HF's cache holds them after the prompt.
    """

    token_ids: tuple[int, ...]
    logits: np.ndarray | None = None
    hidden_states: tuple[np.ndarray, ...] | None = None
    attentions: dict[int, np.ndarray] | None = None
    router_logits: dict[int, np.ndarray] | None = None
    selected_experts: dict[int, np.ndarray] | None = None
    routing_weights: dict[int, np.ndarray] | None = None
    indexer_selections: dict[int, np.ndarray] | None = None
    recurrent_states: dict[int, dict[str, np.ndarray]] | None = None


def decoder_layers(loaded):
    """The ``LayerSpec``s of ``loaded``'s decoder; a capture needs them."""
    spec = getattr(loaded.model_cls, "spec", None)
    if spec is None:
        raise InvalidRequestError(f"{loaded.model_cls.__name__} is not a jaxinfer decoder: only logits can be "
                                  "computed, no captures")
    return spec(loaded.config).layers


def _check_attention_size(loaded, request: requests.CaptureRequest, batch: Batch) -> None:
    layers = request.layers_of("attentions")
    if not layers:
        return
    heads = loaded.config.num_attention_heads
    size = 4 * batch.num_tokens * heads * batch.num_keys * len(layers)
    if size > MAX_ATTENTION_BYTES:
        raise InvalidRequestError(
            f"attention probabilities of {len(layers)} layer(s) over {batch.num_tokens} token rows x {batch.num_keys} "
            f"keys x {heads} heads (padded to buckets) would take {size >> 20} MiB, more than the "
            f"{MAX_ATTENTION_BYTES >> 20} MiB a research forward computes: ask for fewer layers "
            "(capture={'attentions': [layer, ...]}) or give shorter or fewer sequences")


def _program(loaded, request, *, logits: bool, logprobs: bool):
    chosen = kernel_registry.selection(kernel_registry.target_for(loaded.mesh))
    key = (chosen, request, logits, logprobs)
    if key not in loaded._forwards:
        loaded._forwards[key] = make_program(loaded, chosen, request, logits=logits, logprobs=logprobs)
    return loaded._forwards[key]


def run(loaded, sequences, request: requests.CaptureRequest, *, logits: bool = True, logprobs: bool = False):
    """-> (the packed batch, the program's outputs as numpy arrays over the padded rows). A forward
    whose memory estimate exceeds what is available is refused before anything is allocated."""
    batch = pack(sequences)
    _check_attention_size(loaded, request, batch)
    program = _program(loaded, request, logits=logits, logprobs=logprobs)
    args = (loaded.params, batch.token_ids, batch.num_new, batch.block_tables, batch.state_slots)
    memory.check_fits(loaded, request, batch, program.implementations(*args), logits=logits, logprobs=logprobs)
    outputs = program(*args)
    return batch, jax.tree_util.tree_map(np.asarray, jax.device_get(outputs))


def _per_layer(outputs, name, layers, take):
    return {layer: take(outputs[f"{name}/{layer}"]) for layer in layers}


def unpack(batch: Batch, outputs: dict, request: requests.CaptureRequest, s: int, token_ids) -> ForwardResult:
    """Sequence ``s``'s ``ForwardResult`` from the padded outputs."""
    rows, n = batch.rows(s), batch.lengths[s]
    fields = {}
    if "logits" in outputs:
        fields["logits"] = outputs["logits"][rows]
    if request.hidden_states:
        fields["hidden_states"] = tuple(outputs["hidden_states"][:, rows])
    take_rows = lambda x: x[rows]  # noqa: E731
    for name, layers in request.layers:
        if name == "attentions":
            fields[name] = _per_layer(outputs, name, layers, lambda p: p[rows, :, :n].transpose(1, 0, 2))
        elif name == "indexer_selections":
            first = batch.first_slot(s)  # cache row of position 0
            fields[name] = _per_layer(outputs, name, layers,
                                      lambda slots: np.where(slots[rows] >= 0, slots[rows] - first, -1))
        elif name == "recurrent_states":
            slot = int(batch.state_slots[s])
            fields[name] = {layer: {key.rsplit("/", 1)[1]: value[slot] for key, value in outputs.items()
                                    if key.startswith(f"{name}/{layer}/")} for layer in layers}
        else:
            fields[name] = _per_layer(outputs, name, layers, take_rows)
    return ForwardResult(tuple(token_ids), **fields)


def prompt_logprobs(batch: Batch, outputs: dict, s: int) -> list[float | None]:
    """Sequence ``s``'s ``[None, log p(t_1 | t_0), ..., log p(t_{n-1} | t_<n-1)]``."""
    rows = batch.rows(s)
    return [None] + [float(x) for x in outputs["logprobs"][rows][:-1]]


__all__ = ["ForwardResult", "MAX_ATTENTION_BYTES", "decoder_layers", "prompt_logprobs", "run", "unpack"]
