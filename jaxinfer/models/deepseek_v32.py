"""DeepSeek-V3.2: DeepSeek-V3 with DeepSeek sparse attention in every layer.

Each layer's MLA carries the lightning indexer (``models/layers/mla.py``, ``Indexer``): ``index_n_heads``
heads of ``index_head_dim``, each token attending to its ``index_topk`` best-scored cached tokens.
Dense and MoE layers follow ``mlp_layer_types`` (HF's default: ``first_k_dense_replace`` dense
layers, then MoE). HF leaves out two steps of DeepSeek's reference indexer, the Hadamard rotation
of q and k (orthogonal: it changes no score) and FP8 scoring (a precision choice); HF is the truth
here, so neither is applied.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.config import ModelConfig
from jaxinfer.models.decoder import DecoderSpec, DenseMLP, LayerSpec, mlp_layer_types
from jaxinfer.models.deepseek_v3 import DeepseekV3ForCausalLM, deepseek_moe, mla_spec
from jaxinfer.models.layers.mla import Indexer


def indexer_spec(config: ModelConfig, *, rope_interleave: bool = False) -> Indexer:
    return Indexer(num_heads=config.int_field("index_n_heads", ge=1), head_dim=config.int_field("index_head_dim", ge=1),
                   top_k=config.int_field("index_topk", ge=1), rope_interleave=rope_interleave)


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    @classmethod
    def spec(cls, config: ModelConfig) -> DecoderSpec:
        # HF's DeepSeek-V3.2 always rotates MLA's rope dims as interleaved pairs (no rope_interleave field).
        mixer = dataclasses.replace(mla_spec(config), rope_interleave=True, indexer=indexer_spec(config))
        moe = deepseek_moe(config)
        return DecoderSpec(tuple(LayerSpec(mixer, moe if kind == "sparse" else DenseMLP())
                                 for kind in mlp_layer_types(config)))
