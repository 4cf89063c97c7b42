"""Qwen3-MoE: Qwen3 attention (per-head q/k norm) with softmax top-k routed experts.

Sparse layers are those not in ``mlp_only_layers`` with ``(i + 1) % decoder_sparse_step == 0``; the
others keep a dense MLP of ``intermediate_size``. Experts are stored per expert on disk
(``mlp.experts.{e}.{gate,up,down}_proj.weight``) and stacked on load.
"""

from __future__ import annotations

from jaxinfer.config import ModelConfig
from jaxinfer.models.decoder import DecoderForCausalLM, DecoderSpec, DenseMLP, LayerSpec, sliding_window
from jaxinfer.models.layers.attention import GQA
from jaxinfer.models.layers.moe import MoESpec
from jaxinfer.models.moe_checkpoints import check_expert_count, per_expert_sources


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    supports_expert_parallel = True

    @classmethod
    def spec(cls, config: ModelConfig) -> DecoderSpec:
        bias = config.bool_field("attention_bias", default=False)
        attention = GQA(qkv_bias=bias, o_bias=bias, qk_norm="head", sliding_window=sliding_window(config))
        num_experts = config.int_field("num_experts", "num_local_experts", ge=0)
        n = config.num_hidden_layers
        dense_only = set(config.int_list_field("mlp_only_layers", ge=0, le=n - 1))
        step = config.int_field("decoder_sparse_step", default=1, ge=1)
        if num_experts == 0:  # HF: every layer keeps a dense MLP
            return DecoderSpec(tuple(LayerSpec(attention, DenseMLP()) for _ in range(n)))
        moe = MoESpec(num_experts=num_experts,
                      top_k=config.int_field("num_experts_per_tok", ge=1, le=num_experts),
                      intermediate_size=config.int_field("moe_intermediate_size", ge=1), router="softmax_topk",
                      norm_topk_prob=config.bool_field("norm_topk_prob", default=False))
        return DecoderSpec(tuple(
            LayerSpec(attention, moe if i not in dense_only and (i + 1) % step == 0 else DenseMLP()) for i in range(n)
        ))

    @classmethod
    def check_checkpoint_layout(cls, config: ModelConfig, checkpoint) -> None:
        super().check_checkpoint_layout(config, checkpoint)
        check_expert_count(checkpoint, "num_experts", config.int_field("num_experts", "num_local_experts", ge=0))

    @classmethod
    def checkpoint_sources(cls, config: ModelConfig, expected: dict, available: set[str]) -> dict:
        return per_expert_sources(cls, expected, {"gate_proj": "gate_proj", "up_proj": "up_proj",
                                                  "down_proj": "down_proj"})
