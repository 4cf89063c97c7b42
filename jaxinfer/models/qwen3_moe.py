"""Qwen3-MoE: Qwen3 attention (per-head q/k norm) with softmax top-k routed experts.

Sparse layers are those not in ``mlp_only_layers`` with ``(i + 1) % decoder_sparse_step == 0``; the
others keep a dense MLP of ``intermediate_size``. Experts are stored per expert on disk
(``mlp.experts.{e}.{gate,up,down}_proj.weight``) and stacked on load.
"""

from __future__ import annotations

from jaxinfer.config import ModelConfig
from jaxinfer.models.decoder import AttentionSpec, DecoderForCausalLM, DecoderSpec, LayerSpec
from jaxinfer.models.layers.moe import MoESpec
from jaxinfer.models.moe_checkpoints import per_expert_sources


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    supports_expert_parallel = True

    @classmethod
    def spec(cls, config: ModelConfig) -> DecoderSpec:
        window = config.get("sliding_window") if config.get("use_sliding_window", False) else None
        attention = AttentionSpec(qkv_bias=bool(config.get("attention_bias", False)),
                                  o_bias=bool(config.get("attention_bias", False)), qk_norm="head",
                                  sliding_window=window)
        moe = MoESpec(num_experts=config.require("num_experts", "num_local_experts"),
                      top_k=config.require("num_experts_per_tok"),
                      intermediate_size=config.require("moe_intermediate_size"), router="softmax_topk",
                      norm_topk_prob=bool(config.get("norm_topk_prob", False)))
        dense_only = set(config.get("mlp_only_layers", []))
        step = config.get("decoder_sparse_step", 1)
        return DecoderSpec(tuple(
            LayerSpec(attention, moe if i not in dense_only and moe.num_experts > 0 and (i + 1) % step == 0 else None)
            for i in range(config.num_hidden_layers)
        ))

    @classmethod
    def checkpoint_sources(cls, config: ModelConfig, expected: dict, available: set[str]) -> dict:
        return per_expert_sources(cls, expected, {"gate_proj": "gate_proj", "up_proj": "up_proj",
                                                  "down_proj": "down_proj"})
