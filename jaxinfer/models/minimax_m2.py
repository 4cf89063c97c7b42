"""MiniMax-M2: GQA with q/k RMSNorm over the whole projected q and k (all heads at once), partial
RoPE, and sigmoid-scored experts chosen with ``e_score_correction_bias`` (stored on the MoE block),
weighted by the normalised unbiased scores; no scaling factor, no groups, no shared expert.
Experts are Mixtral-style on disk: ``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``.
"""

from __future__ import annotations

from jaxinfer.config import ModelConfig
from jaxinfer.models.decoder import DecoderForCausalLM, DecoderSpec, LayerSpec
from jaxinfer.models.layers.attention import GQA
from jaxinfer.models.layers.moe import MoESpec
from jaxinfer.models.moe_checkpoints import check_expert_count, per_expert_sources


class MiniMaxM2ForCausalLM(DecoderForCausalLM):
    supports_expert_parallel = True

    @classmethod
    def spec(cls, config: ModelConfig) -> DecoderSpec:
        attention = GQA(qk_norm="full")
        num_experts = config.int_field("num_local_experts", "num_experts", ge=1)
        moe = MoESpec(num_experts=num_experts, top_k=config.int_field("num_experts_per_tok", ge=1, le=num_experts),
                      intermediate_size=config.int_field("intermediate_size", ge=1), router="sigmoid_bias",
                      norm_topk_prob=True)
        return DecoderSpec(tuple(LayerSpec(attention, moe, ffn_name="block_sparse_moe")
                                 for _ in range(config.num_hidden_layers)))

    @classmethod
    def check_checkpoint_layout(cls, config: ModelConfig, checkpoint) -> None:
        super().check_checkpoint_layout(config, checkpoint)
        check_expert_count(checkpoint, "num_local_experts", config.int_field("num_local_experts", "num_experts", ge=0))

    @classmethod
    def checkpoint_sources(cls, config: ModelConfig, expected: dict, available: set[str]) -> dict:
        return per_expert_sources(cls, expected, {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})
