"""Kimi-Linear: a hybrid of KDA layers (``jaxinfer.models.layers.kda``) and NoPE MLA layers.

``layer_types`` says which layers are KDA ("linear_attention") and which MLA ("full_attention");
HF's config class derives it from a hub config's 1-indexed ``linear_attn_config.kda_layers`` /
``full_attn_layers``. The MLA has no RoPE at all (the k_rope slice is kept but never rotated), no q
LoRA, softmax scale ``qk_head_dim ** -0.5`` and every head expanded from the latent, so
``num_key_value_heads`` must equal ``num_attention_heads``. ``mlp_layer_types`` (from
``first_k_dense_replace``) says which layers keep a dense MLP and which route DeepSeek-style: sigmoid
scores plus ``e_score_correction_bias`` choose the top-k, the unbiased scores weight them, normalised
(``moe_renormalize``) and times ``routed_scaling_factor``, plus an ungated shared expert.

On disk every layer's feed-forward, dense or sparse, is ``block_sparse_moe.*`` as transformers saves
it (the hub's original checkpoints keep the dense one as ``mlp.*``, which loads too); experts are
per-expert ``w1`` / ``w3`` / ``w2`` (gate / up / down).
"""

from __future__ import annotations

from jaxinfer.config import ModelConfig
from jaxinfer.errors import ConfigError
from jaxinfer.models.decoder import DecoderForCausalLM, DecoderSpec, DenseMLP, LayerSpec, mlp_layer_types
from jaxinfer.models.deepseek_v3 import mla_spec
from jaxinfer.models.layers.kda import KDA
from jaxinfer.models.layers.moe import MoESpec
from jaxinfer.models.moe_checkpoints import check_expert_count, per_expert_sources
from jaxinfer.models.qwen3_next import hybrid_layer_types
from jaxinfer.weights import Tensor

FFN_NAME = "block_sparse_moe"
HUB_DENSE_FFN_NAME = "mlp"
EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def kimi_moe(config: ModelConfig) -> MoESpec:
    """The routed and shared experts, from the config's names as HF stores them (``num_experts``,
    ``num_experts_per_token``, ``num_expert_group``, ``moe_renormalize``, ``num_shared_experts``)."""
    experts = config.int_field("num_experts", ge=1)
    groups = config.int_field("num_expert_group", default=1, ge=1)
    if experts % groups:
        raise ConfigError(f"num_experts ({experts}) must be a multiple of num_expert_group ({groups})")
    topk_group = config.int_field("topk_group", default=1, ge=1, le=groups)
    top_k = config.int_field("num_experts_per_token", ge=1, le=topk_group * experts // groups)
    size = config.int_field("moe_intermediate_size", ge=1)
    shared = config.int_field("num_shared_experts", default=0, ge=0)
    return MoESpec(num_experts=experts, top_k=top_k, intermediate_size=size, router="sigmoid_bias",
                   norm_topk_prob=config.bool_field("moe_renormalize", default=True), norm_eps=1e-20,
                   routed_scaling_factor=config.float_field("routed_scaling_factor", gt=0), n_group=groups,
                   topk_group=topk_group, shared_intermediate_size=size * shared or None,
                   shared_expert_name="shared_experts", router_float32=True)


def check_latent_heads(config: ModelConfig) -> None:
    """``ConfigError`` unless every head has its own KV head: these families' MLA expands every head's
    key and value from the latent."""
    if config.num_key_value_heads != config.num_attention_heads:
        raise ConfigError(f"num_key_value_heads ({config.num_key_value_heads}) must equal num_attention_heads "
                          f"({config.num_attention_heads}): {config.model_type}'s MLA expands every head's key and "
                          "value from the latent")


def check_sparse_layer_experts(cls, config: ModelConfig, checkpoint) -> None:
    """Where the model has MoE layers, the checkpoint's per-expert tensors are experts 0..num_experts-1
    (the tensors the family skips aside)."""
    if "sparse" in mlp_layer_types(config):
        skipped = tuple(pattern for pattern, _ in cls.skipped_checkpoint_keys_for(config))
        check_expert_count(checkpoint, "num_experts", config.int_field("num_experts", ge=1), skipped)


class KimiLinearForCausalLM(DecoderForCausalLM):
    supports_expert_parallel = True

    @classmethod
    def spec(cls, config: ModelConfig) -> DecoderSpec:
        kinds, ffns = hybrid_layer_types(config), mlp_layer_types(config)
        kda, mla = KDA(), mla_spec(config, use_rope=False)
        moe = kimi_moe(config) if "sparse" in ffns else None
        return DecoderSpec(tuple(
            LayerSpec(kda if kind == "linear_attention" else mla, moe if ffn == "sparse" else DenseMLP(),
                      ffn_name=FFN_NAME)
            for kind, ffn in zip(kinds, ffns)))

    @classmethod
    def validate_config(cls, config: ModelConfig) -> None:
        super().validate_config(config)
        check_latent_heads(config)

    @classmethod
    def check_checkpoint_layout(cls, config: ModelConfig, checkpoint) -> None:
        super().check_checkpoint_layout(config, checkpoint)
        check_sparse_layer_experts(cls, config, checkpoint)

    @classmethod
    def checkpoint_sources(cls, config: ModelConfig, expected: dict, available: set[str]) -> dict:
        sources = per_expert_sources(cls, expected, EXPERT_NAMES)
        for path, source in sources.items():
            name = source.names[0]
            if path[-1] == "e_score_correction_bias":  # HF keeps it on the router
                sources[path] = Tensor(cls.path_to_checkpoint_name(path[:-1]) + ".gate.e_score_correction_bias")
            elif isinstance(source, Tensor) and f".{FFN_NAME}." in name and name not in available:
                hub_name = name.replace(f".{FFN_NAME}.", f".{HUB_DENSE_FFN_NAME}.")
                if hub_name in available:  # a dense MLP as the hub's original checkpoints name it
                    sources[path] = Tensor(hub_name)
        return sources
