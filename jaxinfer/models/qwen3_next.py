"""The Qwen gated-DeltaNet hybrids: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (their text models).

``layer_types`` says which layers are gated DeltaNet ("linear_attention",
``jaxinfer.models.layers.gated_deltanet``) and which are gated full attention ("full_attention": GQA
whose ``q_proj`` gives ``[q | gate]`` per head, a sigmoid output gate, (1 + w) per-head q/k norms and
partial RoPE; Qwen3.5's interleaved M-RoPE is that RoPE for text, whose three position rows are
equal). Every RMSNorm of the decoder is (1 + w). MoE layers route softmax top-k and add a shared
expert gated by ``sigmoid(shared_expert_gate(x))``.

The families differ in the DeltaNet's projection layout (Qwen3-Next groups them per key head,
Qwen3.5 keeps them flat) and in which layers are sparse: Qwen3-Next as Qwen3-MoE
(``decoder_sparse_step``, ``mlp_only_layers``), Qwen3.5 none, Qwen3.5-MoE all (always renormalised).
Checkpoints of the multimodal wrappers (``model.language_model.*``) load too; their vision towers are
skipped.
"""

from __future__ import annotations

from jaxinfer.config import ModelConfig
from jaxinfer.models.decoder import DecoderForCausalLM, DecoderSpec, DenseMLP, LayerSpec, NormStyle
from jaxinfer.models.layers.attention import GQA
from jaxinfer.models.layers.gated_deltanet import GatedDeltaNet
from jaxinfer.models.layers.moe import MoESpec
from jaxinfer.models.moe_checkpoints import check_expert_count, per_expert_sources

LAYER_TYPES = ("linear_attention", "full_attention")


def hybrid_layer_types(config: ModelConfig) -> tuple[str, ...]:
    """``layer_types`` checked: one "linear_attention" or "full_attention" per layer (HF's config
    classes derive it from ``full_attention_interval`` when a checkpoint does not list it)."""
    return config.layer_kinds("layer_types", LAYER_TYPES)


class Qwen3NextForCausalLM(DecoderForCausalLM):
    """Qwen3-Next; Qwen3.5 and Qwen3.5-MoE below change the projection layout and the sparse layers."""

    supports_expert_parallel = True
    deltanet_layout = "grouped"

    @classmethod
    def sparse_layers(cls, config: ModelConfig, num_experts: int) -> tuple[bool, ...]:
        n = config.num_hidden_layers
        dense_only = set(config.int_list_field("mlp_only_layers", ge=0, le=n - 1))
        step = config.int_field("decoder_sparse_step", default=1, ge=1)
        return tuple(num_experts > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(n))

    @classmethod
    def norm_topk_prob(cls, config: ModelConfig) -> bool:
        return config.bool_field("norm_topk_prob", default=True)

    @classmethod
    def num_experts(cls, config: ModelConfig) -> int:
        return config.int_field("num_experts", default=0, ge=0)

    @classmethod
    def spec(cls, config: ModelConfig) -> DecoderSpec:
        bias = config.bool_field("attention_bias", default=False)
        attention = GQA(qkv_bias=bias, o_bias=bias, qk_norm="head", qk_norm_unit_offset=True, output_gate=True)
        deltanet = GatedDeltaNet(cls.deltanet_layout)
        num_experts = cls.num_experts(config)
        moe = None
        if num_experts:
            moe = MoESpec(num_experts=num_experts, top_k=config.int_field("num_experts_per_tok", ge=1, le=num_experts),
                          intermediate_size=config.int_field("moe_intermediate_size", ge=1), router="softmax_topk",
                          norm_topk_prob=cls.norm_topk_prob(config),
                          shared_intermediate_size=config.int_field("shared_expert_intermediate_size", ge=1),
                          shared_expert_gated=True)
        layers = tuple(
            LayerSpec(deltanet if kind == "linear_attention" else attention, moe if sparse else DenseMLP())
            for kind, sparse in zip(hybrid_layer_types(config), cls.sparse_layers(config, num_experts)))
        return DecoderSpec(layers, norm=NormStyle(unit_offset=True))

    @classmethod
    def skipped_checkpoint_keys_for(cls, config: ModelConfig) -> tuple[tuple[str, str], ...]:
        return super().skipped_checkpoint_keys_for(config) + ((r"^mtp\.", "multi-token-prediction layers"),)

    @classmethod
    def check_checkpoint_layout(cls, config: ModelConfig, checkpoint) -> None:
        super().check_checkpoint_layout(config, checkpoint)
        if cls.num_experts(config):
            skipped = tuple(pattern for pattern, _ in cls.skipped_checkpoint_keys_for(config))
            check_expert_count(checkpoint, "num_experts", cls.num_experts(config), skipped)

    @classmethod
    def checkpoint_sources(cls, config: ModelConfig, expected: dict, available: set[str]) -> dict:
        return per_expert_sources(cls, expected, {"gate_proj": "gate_proj", "up_proj": "up_proj",
                                                  "down_proj": "down_proj"})


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 (dense): flat DeltaNet projections, a dense MLP in every layer."""

    supports_expert_parallel = False
    deltanet_layout = "flat"

    @classmethod
    def num_experts(cls, config: ModelConfig) -> int:
        return 0


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5-MoE: flat DeltaNet projections, every layer sparse, top-k always renormalised."""

    deltanet_layout = "flat"

    @classmethod
    def sparse_layers(cls, config: ModelConfig, num_experts: int) -> tuple[bool, ...]:
        return (True,) * config.num_hidden_layers

    @classmethod
    def num_experts(cls, config: ModelConfig) -> int:
        return config.int_field("num_experts", ge=1)

    @classmethod
    def norm_topk_prob(cls, config: ModelConfig) -> bool:
        return True
