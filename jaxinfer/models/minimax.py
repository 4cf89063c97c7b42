"""MiniMax-Text-01 (HF model_type "minimax"): lightning attention hybrid with softmax-routed experts.

``layer_types`` says which layers are lightning attention ("linear_attention",
``jaxinfer.models.layers.lightning``; decay from the global layer index) and which are GQA
("full_attention": RoPE over the **whole** head_dim, whatever ``partial_rotary_factor`` or
``rotary_dim`` say, as HF's MiniMax rotary; no qk-norm; ``sliding_window`` where set). HF's config
derives ``layer_types`` (alternating, full first) when a config leaves it unset and never reads
``attn_type_list``; so does this. The residual is the normed stream: ``n = LN1(x)``,
``h = a * n + b * mixer(n)`` with (a, b) the ``linear_attn_*`` or ``full_attn_*`` factors, then
``m = LN2(h)``, ``out = a' * m + b' * moe(m)`` (``mlp_*`` factors). Every layer's MoE routes softmax
top-k, renormalised, no shared expert; experts are Mixtral-style on disk
(``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``).
"""

from __future__ import annotations

import dataclasses

from jaxinfer.config import ModelConfig
from jaxinfer.errors import ConfigError
from jaxinfer.models.base import CausalLM
from jaxinfer.models.decoder import DecoderForCausalLM, DecoderSpec, LayerSpec, sliding_window
from jaxinfer.models.residual import ScaledNormedResidual
from jaxinfer.models.layers.attention import GQA
from jaxinfer.models.layers.lightning import DECAY_BUFFERS, LightningAttention
from jaxinfer.models.layers.moe import MoESpec
from jaxinfer.models.layers.rope import RotaryEmbedding
from jaxinfer.models.moe_checkpoints import check_expert_count, per_expert_sources
from jaxinfer.models.qwen3_next import hybrid_layer_types


@dataclasses.dataclass(frozen=True)
class FullWidthRopeGQA(GQA):
    """GQA whose RoPE rotates the whole head, as HF's ``MiniMaxRotaryEmbedding``: its default
    frequencies are over ``head_dim`` whatever the partial factor; the other RoPE types take their
    width from the partial factor while ``rotate_half`` covers the whole head, which HF cannot run
    unless the factor is 1."""

    def validate(self, config) -> None:
        super().validate(config)
        rope = config.rope_for(self.rope_layer_type)
        if rope.rope_type != "default" and rope.partial_rotary_factor != 1.0:
            raise ConfigError(f"rope type {rope.rope_type!r} with partial_rotary_factor {rope.partial_rotary_factor}: "
                              f"{config.model_type} attention rotates the whole head_dim, so only the default "
                              "RoPE may carry a partial factor (which it ignores)")

    def rotary(self, config) -> RotaryEmbedding:
        rope = dataclasses.replace(config.rope_for(self.rope_layer_type), partial_rotary_factor=1.0)
        return RotaryEmbedding(rope, config.head_dim, config.max_position_embeddings)


def _factor(config: ModelConfig, key: str) -> float:
    return float(config.float_field(key, default=1))


class MiniMaxForCausalLM(DecoderForCausalLM):
    supports_expert_parallel = True
    # HF's block-wise prefill tables: persistent buffers derived from the config, not parameters.
    ignored_checkpoint_keys = CausalLM.ignored_checkpoint_keys + (
        rf"\.self_attn\.({'|'.join(DECAY_BUFFERS)})$",)

    @classmethod
    def num_experts(cls, config: ModelConfig) -> int:
        return config.int_field("num_local_experts", "num_experts", ge=1)

    @classmethod
    def spec(cls, config: ModelConfig) -> DecoderSpec:
        attention = FullWidthRopeGQA(sliding_window=sliding_window(config))
        num_experts = cls.num_experts(config)
        moe = MoESpec(num_experts=num_experts, top_k=config.int_field("num_experts_per_tok", ge=1, le=num_experts),
                      intermediate_size=config.int_field("intermediate_size", ge=1), router="softmax_topk",
                      norm_topk_prob=True)
        ffn_alpha, ffn_beta = _factor(config, "mlp_alpha_factor"), _factor(config, "mlp_beta_factor")
        layers = []
        for i, kind in enumerate(hybrid_layer_types(config)):
            prefix = "linear_attn" if kind == "linear_attention" else "full_attn"
            residual = ScaledNormedResidual(_factor(config, f"{prefix}_alpha_factor"),
                                            _factor(config, f"{prefix}_beta_factor"), ffn_alpha, ffn_beta)
            mixer = LightningAttention(i) if kind == "linear_attention" else attention
            layers.append(LayerSpec(mixer, moe, residual, ffn_name="block_sparse_moe"))
        return DecoderSpec(tuple(layers))

    @classmethod
    def check_checkpoint_layout(cls, config: ModelConfig, checkpoint) -> None:
        super().check_checkpoint_layout(config, checkpoint)
        check_expert_count(checkpoint, "num_local_experts", cls.num_experts(config))

    @classmethod
    def checkpoint_sources(cls, config: ModelConfig, expected: dict, available: set[str]) -> dict:
        return per_expert_sources(cls, expected, {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})
