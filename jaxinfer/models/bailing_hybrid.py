"""Bailing-MoE-V3 (Ling 3, ``BailingHybridForCausalLM``): KDA layers and MLA layers with DeepSeek routing.

``layer_types`` says which layers are KDA ("linear_attention") and which MLA ("full_attention"); HF's
config class derives it from ``layer_group_size`` (the last layer of every group is MLA: 5 KDA + 1 MLA
at 6) when a checkpoint does not list it. The KDA layers (``models/layers/kda.py``) project their forget
and output gates at full rank (``forget_gate.f_proj``, ``g_proj``) and, with ``kda_safe_gate``, bound the
log-decay to ``(kda_lower_bound, 0)``. The MLA layers rotate interleaved pairs (always: the config has
no ``rope_interleave``), scale each head's output by ``sigmoid(g_proj(x))`` and expand every head from
the latent, so ``num_key_value_heads`` must equal ``num_attention_heads``. ``mlp_layer_types`` (from
``first_k_dense_replace``) says which layers keep a dense MLP and which route DeepSeek-style (as
Kimi-Linear: ``models/kimi_linear.py``), with an ungated shared expert.

On disk the names are Ling's, which transformers converts on load and back on save:
``model.word_embeddings``, ``layers.N.attention.*`` with ``dense`` for o_proj and the forget gate's
``f_proj`` / ``A_log`` / ``dt_bias`` directly under it, q/k/v convs apart, ``gate.expert_bias``, experts
one tensor per expert. Multi-token-prediction layers (``model.layers.{num_hidden_layers}...``) are not served.
"""

from __future__ import annotations

import dataclasses
import re

from jaxinfer.config import ModelConfig
from jaxinfer.models.decoder import DecoderForCausalLM, DecoderSpec, DenseMLP, LayerSpec, mlp_layer_types
from jaxinfer.models.deepseek_v3 import mla_spec, mtp_checkpoint_keys
from jaxinfer.models.kimi_linear import check_latent_heads, check_sparse_layer_experts, kimi_moe
from jaxinfer.models.layers.kda import KDA
from jaxinfer.models.moe_checkpoints import per_expert_sources
from jaxinfer.models.qwen3_next import hybrid_layer_types
from jaxinfer.weights import Tensor

EXPERT_NAMES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
# (pattern, replacement) from the parameter tree's names (HF's in memory) to Ling's on disk, in order.
DISK_NAMES = ((r"^model\.embed_tokens\.", "model.word_embeddings."),
              (r"\.self_attn\.forget_gate\.", ".self_attn."),
              (r"\.self_attn\.o_proj\.", ".self_attn.dense."),
              (r"\.self_attn\.", ".attention."))


def kda_spec(config: ModelConfig) -> KDA:
    """The KDA mixer with Bailing's full-rank gates and, with ``kda_safe_gate``, the bounded decay."""
    safe = config.bool_field("kda_safe_gate", default=True)
    bound = config.float_field("kda_lower_bound", default=-5.0, lt=0) if safe else None
    return KDA(full_rank_gates=True, safe_gate_lower_bound=bound, float32_conv=True)


def disk_name(name: str) -> str:
    """A parameter's checkpoint name (HF's, as in memory) -> Ling's, as the checkpoint stores it."""
    for pattern, replacement in DISK_NAMES:
        name = re.sub(pattern, replacement, name)
    return name


class BailingHybridForCausalLM(DecoderForCausalLM):
    supports_expert_parallel = True

    @classmethod
    def spec(cls, config: ModelConfig) -> DecoderSpec:
        kinds, ffns = hybrid_layer_types(config), mlp_layer_types(config)
        kda = kda_spec(config)
        mla = dataclasses.replace(mla_spec(config), rope_interleave=True, output_gate=True)
        moe = kimi_moe(config) if "sparse" in ffns else None
        return DecoderSpec(tuple(LayerSpec(kda if kind == "linear_attention" else mla,
                                           moe if ffn == "sparse" else DenseMLP())
                                 for kind, ffn in zip(kinds, ffns)))

    @classmethod
    def validate_config(cls, config: ModelConfig) -> None:
        super().validate_config(config)
        check_latent_heads(config)

    @classmethod
    def skipped_checkpoint_keys_for(cls, config: ModelConfig) -> tuple[tuple[str, str], ...]:
        return super().skipped_checkpoint_keys_for(config) + mtp_checkpoint_keys(config)

    @classmethod
    def check_checkpoint_layout(cls, config: ModelConfig, checkpoint) -> None:
        super().check_checkpoint_layout(config, checkpoint)
        check_sparse_layer_experts(cls, config, checkpoint)

    @classmethod
    def checkpoint_sources(cls, config: ModelConfig, expected: dict, available: set[str]) -> dict:
        sources = per_expert_sources(cls, expected, EXPERT_NAMES)
        for path, source in sources.items():
            if path[-1] == "e_score_correction_bias":  # HF keeps it on the router; Ling calls it expert_bias
                sources[path] = Tensor(cls.path_to_checkpoint_name(path[:-1]) + ".gate.expert_bias")
            elif isinstance(source, Tensor):
                sources[path] = Tensor(disk_name(source.names[0]))
        return sources
