"""DeepSeek-V3 (and the configs that are DeepSeek-V3 underneath: Sarvam-MLA, Kimi K2.5's text model).

MLA attention (``models/layers/mla.py``) in every layer; the first ``first_k_dense_replace`` layers
keep a dense MLP, the others an MoE block: sigmoid scores plus ``e_score_correction_bias`` choose
the top-k within the best ``topk_group`` of ``n_group`` groups, the unbiased scores weight them
(normalised with ``+ 1e-20`` when ``norm_topk_prob``) times ``routed_scaling_factor``, and an
ungated shared expert of ``moe_intermediate_size * n_shared_experts`` is added to every token. The
router's weight and bias stay float32, as HF keeps them. With YaRN the softmax scale is
``qk_head_dim ** -0.5 * mscale(factor, mscale_all_dim) ** 2``. Experts are per-expert tensors on disk.
Multi-token-prediction layers in a checkpoint (``model.layers.{num_hidden_layers}...``) are not served.
"""

from __future__ import annotations

import math

from jaxinfer.config import ModelConfig
from jaxinfer.errors import ConfigError
from jaxinfer.models.decoder import DecoderForCausalLM, DecoderSpec, DenseMLP, LayerSpec
from jaxinfer.models.layers.mla import MLA
from jaxinfer.models.layers.moe import MoESpec
from jaxinfer.models.moe_checkpoints import check_expert_count, per_expert_sources
from jaxinfer.weights import Tensor


def yarn_softmax_scale(config: ModelConfig, qk_head_dim: int) -> float:
    """HF's ``yarn_apply_mscale``: ``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2``
    for a scaled RoPE that sets ``mscale_all_dim``."""
    scale = qk_head_dim ** -0.5
    rope = config.rope
    if rope.rope_type != "default" and rope.mscale_all_dim:
        factor = rope.factor
        mscale = 1.0 if factor <= 1 else 0.1 * rope.mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def mla_spec(config: ModelConfig, *, use_rope: bool = True) -> MLA:
    """The MLA mixer of a DeepSeek-style config, its sizes checked."""
    rope_dim = config.int_field("qk_rope_head_dim", ge=2 if use_rope else 0)
    nope_dim = config.int_field("qk_nope_head_dim", ge=0)
    if nope_dim + rope_dim < 1:
        raise ConfigError("qk_nope_head_dim + qk_rope_head_dim must be at least 1")
    return MLA(kv_lora_rank=config.int_field("kv_lora_rank", ge=1), qk_nope_head_dim=nope_dim,
               qk_rope_head_dim=rope_dim, v_head_dim=config.int_field("v_head_dim", ge=1),
               q_lora_rank=config.int_field("q_lora_rank", default=None, ge=1),
               attention_bias=config.bool_field("attention_bias", default=False),
               rope_interleave=config.bool_field("rope_interleave", default=True), use_rope=use_rope,
               softmax_scale=yarn_softmax_scale(config, nope_dim + rope_dim) if use_rope else None)


def mtp_checkpoint_keys(config: ModelConfig) -> tuple[tuple[str, str], ...]:
    """(regex, what) of multi-token-prediction layers, which sit after the last decoder layer
    (``num_nextn_predict_layers`` of them, at least one) or under ``mtp.``; HF does not load them either."""
    n, extra = config.num_hidden_layers, max(config.int_field("num_nextn_predict_layers", default=1, ge=0), 1)
    layers = "|".join(str(n + i) for i in range(extra))
    return ((rf"^model\.layers\.({layers})\.", "multi-token-prediction layers"),
            (r"^mtp\.", "multi-token-prediction layers"))


def deepseek_moe(config: ModelConfig) -> MoESpec:
    """DeepSeek's routed experts and shared expert, from ``n_routed_experts`` ... ``routed_scaling_factor``."""
    experts = config.int_field("n_routed_experts", ge=1)
    groups = config.int_field("n_group", default=1, ge=1)
    if experts % groups:
        raise ConfigError(f"n_routed_experts ({experts}) must be a multiple of n_group ({groups})")
    topk_group = config.int_field("topk_group", default=1, ge=1, le=groups)
    top_k = config.int_field("num_experts_per_tok", ge=1, le=topk_group * experts // groups)
    size = config.int_field("moe_intermediate_size", ge=1)
    shared = config.int_field("n_shared_experts", default=0, ge=0)
    return MoESpec(num_experts=experts, top_k=top_k, intermediate_size=size, router="sigmoid_bias",
                   norm_topk_prob=config.bool_field("norm_topk_prob", default=True), norm_eps=1e-20,
                   routed_scaling_factor=config.float_field("routed_scaling_factor", default=1.0, gt=0),
                   n_group=groups, topk_group=topk_group, shared_intermediate_size=size * shared or None,
                   shared_expert_name="shared_experts", router_float32=True)


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    supports_expert_parallel = True

    @classmethod
    def spec(cls, config: ModelConfig) -> DecoderSpec:
        mixer, moe = mla_spec(config), deepseek_moe(config)
        n = config.num_hidden_layers
        dense = config.int_field("first_k_dense_replace", default=0, ge=0, le=n)
        return DecoderSpec(tuple(LayerSpec(mixer, DenseMLP() if i < dense else moe) for i in range(n)))

    @classmethod
    def skipped_checkpoint_keys_for(cls, config: ModelConfig) -> tuple[tuple[str, str], ...]:
        return super().skipped_checkpoint_keys_for(config) + mtp_checkpoint_keys(config)

    @classmethod
    def check_checkpoint_layout(cls, config: ModelConfig, checkpoint) -> None:
        super().check_checkpoint_layout(config, checkpoint)
        skipped = tuple(pattern for pattern, _ in cls.skipped_checkpoint_keys_for(config))
        check_expert_count(checkpoint, "n_routed_experts", config.int_field("n_routed_experts", ge=1), skipped)

    @classmethod
    def checkpoint_sources(cls, config: ModelConfig, expected: dict, available: set[str]) -> dict:
        sources = per_expert_sources(cls, expected, {"gate_proj": "gate_proj", "up_proj": "up_proj",
                                                     "down_proj": "down_proj"})
        for path in sources:
            if path[-1] == "e_score_correction_bias":  # HF keeps it on the router
                sources[path] = Tensor(cls.path_to_checkpoint_name(path[:-1]) + ".gate.e_score_correction_bias")
        return sources
