"""What layers record when a research forward asks for it (``jaxinfer.research``).

Each kind of record is its own Flax collection. A layer computes and records a value only while its
collection is mutable (``model.apply(..., mutable=[ATTENTIONS])``), so a serving forward, which
makes none mutable, traces nothing of it. Values are recorded with ``Module.sow`` under the
recording module's path (``model/layers_3/self_attn/probs``), from which the research forward reads
the layer index.
"""

from __future__ import annotations

import flax.linen as nn

HIDDEN_STATES = "hidden_states"  # the decoder: "embeddings", "layer_outputs" (one per layer, in order), "final"
ATTENTIONS = "attentions"  # softmax-attention mixers: "probs" [T, heads, keys of the token's sequence]
ROUTING = "routing"  # MoE blocks: "router_logits" [T, E], "selected_experts" [T, k], "routing_weights" [T, k]
INDEXER = "indexer"  # sparse-attention indexers: "selected_slots" [T, top_k] (cache rows, -1: none)
COLLECTIONS = (HIDDEN_STATES, ATTENTIONS, ROUTING, INDEXER)


def wanted(module: nn.Module, collection: str) -> bool:
    """Whether ``module`` should compute and record ``collection``'s values in this call (never
    while parameters are being initialised)."""
    return module.is_mutable_collection(collection) and not module.is_initializing()


def record(module: nn.Module, collection: str, name: str, value) -> None:
    """Append ``value`` to ``module``'s ``name`` in ``collection`` (a no-op where it is not mutable)."""
    module.sow(collection, name, value)


__all__ = ["ATTENTIONS", "COLLECTIONS", "HIDDEN_STATES", "INDEXER", "ROUTING", "record", "wanted"]
