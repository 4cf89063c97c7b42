"""HY-V4 (``HYV4ForCausalLM``): DeepSeek sparse attention over MLA, with hyper-connections as its residual.

- MLA as DeepSeek-V3's, but its RoPE is half-split (``rotate_half``, no interleaving), each head has a
  learned float32 sink logit in its softmax, and each head's values are scaled by
  ``sigmoid(gate_proj(x))`` (one gate per value dim) before o_proj.
- The indexer: DeepSeek-V3.2's, rotating its *last* ``qk_rope_head_dim`` dims, its key LayerNorm at
  ``rms_norm_eps``, ``head_dim ** -0.5`` folded into the head weights (HF's rounding order).
  ``indexer_types``: a "shared" layer reuses the last full layer's selection (as GLM-5).
- ``mlp_layer_types``: dense gated MLPs or DeepSeek MoE blocks (sigmoid + correction bias, a shared
  expert) whose routed experts clamp their SwiGLU at ``swiglu_limit`` (gate above, up both sides).
- The residual is independent hyper-connections (``hc_mult`` streams; ``models/residual.py``).
- As HF forces: the sinks, hyper-connections, router, indexer ``weights_proj`` and ``k_norm`` and an
  untied LM head are float32 at any serving dtype (the head reads the final hidden state in float32).

On disk (HF's save layout) the experts are fused, ``gate_up_proj`` ``[E, 2I, H]`` (gate rows first)
and ``down_proj`` ``[E, H, I]``; the sinks are ``learnable_sink_param``, the gate projections
``linear_gate``, the hyper-connections ``hc_pre.hc_{attn,mlp}_layer.hc_*`` and ``hc_pre.hc_head.hc_head_*``.
HF's in-memory names are read too. Multi-token-prediction layers are not served.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from jaxinfer.cache.metadata import StepMetadata
from jaxinfer.config import ModelConfig
from jaxinfer.errors import ConfigError
from jaxinfer.models.decoder import DecoderForCausalLM, DecoderModel, DecoderSpec, DenseMLP, LayerSpec, mlp_layer_types
from jaxinfer.models.deepseek_v3 import deepseek_moe, mla_spec, mtp_checkpoint_keys
from jaxinfer.models.deepseek_v32 import indexer_spec
from jaxinfer.models.glm_moe_dsa import indexer_types
from jaxinfer.models.layers.linear import Linear
from jaxinfer.models.residual import IndependentHyperConnections
from jaxinfer.sharding import local
from jaxinfer.sharding.plan import VOCAB
from jaxinfer.weights import Derived, Tensor

# HF's in-memory name suffix -> the one save_pretrained writes (the hub's).
_SAVED_NAMES = (
    (".self_attn.sinks", ".self_attn.learnable_sink_param"),
    (".gate_proj.weight", ".linear_gate.weight"),
    (".attn_hc.fn", ".hc_pre.hc_attn_layer.hc_fn"), (".attn_hc.base", ".hc_pre.hc_attn_layer.hc_base"),
    (".attn_hc.scale", ".hc_pre.hc_attn_layer.hc_scale"), (".ffn_hc.fn", ".hc_pre.hc_mlp_layer.hc_fn"),
    (".ffn_hc.base", ".hc_pre.hc_mlp_layer.hc_base"), (".ffn_hc.scale", ".hc_pre.hc_mlp_layer.hc_scale"),
    (".hc_head.hc_fn", ".hc_pre.hc_head.hc_head_fn"), (".hc_head.hc_base", ".hc_pre.hc_head.hc_head_base"),
    (".hc_head.hc_scale", ".hc_pre.hc_head.hc_head_scale"),
)


def _saved_name(name: str) -> str:
    for memory, saved in _SAVED_NAMES:
        if name.endswith(memory):
            return name[: -len(memory)] + saved
    return name


def hyper_connections(config: ModelConfig) -> IndependentHyperConnections:
    """The iHC residual from ``hc_mult`` (at least one stream), ``hc_eps`` and ``hc_magnitude``."""
    streams = config.int_field("hc_mult", default=4)
    if streams < 1:
        raise ConfigError(f"hc_mult must be at least 1 (the number of residual streams), got {streams}")
    return IndependentHyperConnections(streams, config.rms_norm_eps, config.float_field("hc_eps", default=1e-6, ge=0),
                                       config.float_field("hc_magnitude", default=2.0))


def clamped_moe(config: ModelConfig):
    """DeepSeek's MoE block with the routed experts' SwiGLU clamped at ``swiglu_limit``."""
    limit = config.float_field("swiglu_limit", default=10.0)
    if limit <= 0:  # HF's docstring says "disabled", but its experts clamp at any value
        raise ConfigError(f"swiglu_limit must be > 0 (HF's experts clamp gate and up at it whatever its sign), "
                          f"got {limit}")
    return dataclasses.replace(deepseek_moe(config), activation="swiglu_clamp", limit=limit)


class HYV4ForCausalLM(DecoderForCausalLM):
    supports_expert_parallel = True

    @classmethod
    def spec(cls, config: ModelConfig) -> DecoderSpec:
        config.layer_kinds("layer_types", ("indexed_attention",), default="indexed_attention")
        mla = dataclasses.replace(mla_spec(config), rope_interleave=False, value_gate=True, sinks=True)
        indexer = dataclasses.replace(indexer_spec(config), rope_last=True, key_norm_eps=config.rms_norm_eps,
                                      scale_in_weights=True, key_norm_float32=True)
        full, shared = dataclasses.replace(mla, indexer=indexer), dataclasses.replace(mla, shares_selection=True)
        moe, residual = clamped_moe(config), hyper_connections(config)
        return DecoderSpec(tuple(
            LayerSpec(full if kind == "full" else shared, moe if mlp == "sparse" else DenseMLP(), residual)
            for kind, mlp in zip(indexer_types(config), mlp_layer_types(config))))

    @nn.compact
    def __call__(self, token_ids, md: StepMetadata, caches, *, all_logits: bool = False):
        """The decoder's forward with HF's float32 LM head -> (float32 logits, caches)."""
        c = self.config
        x, embed, caches = DecoderModel(c, type(self).spec(c), self.dtype, name="model")(token_ids, md, caches)
        if not all_logits:
            x = x[md.logits_indices]
        if type(self).ties_lm_head(c):
            return embed.attend(x).astype(jnp.float32), caches
        head = Linear(c.vocab_size, False, jnp.float32, (VOCAB, None), name="lm_head")
        return local.gather(head(x.astype(jnp.float32)), VOCAB), caches

    @classmethod
    def skipped_checkpoint_keys_for(cls, config: ModelConfig) -> tuple[tuple[str, str], ...]:
        mtp = [pattern for pattern, _ in mtp_checkpoint_keys(config)] + [r"^model\.mtp_layers\."]
        return super().skipped_checkpoint_keys_for(config) + (("|".join(f"(?:{p})" for p in mtp),
                                                               "multi-token-prediction layers"),)

    @classmethod
    def checkpoint_sources(cls, config: ModelConfig, expected: dict, available: set[str]) -> dict:
        sources = {}
        for path, struct in expected.items():
            name = cls.path_to_checkpoint_name(path)
            if path[-1] == "e_score_correction_bias":  # HF keeps it on the router
                sources[path] = Tensor(cls.path_to_checkpoint_name(path[:-1]) + ".gate.e_score_correction_bias")
            elif len(path) >= 2 and path[-2] == "experts" and path[-1] in ("gate_proj", "up_proj"):
                first = path[-1] == "gate_proj"
                fused = cls.path_to_checkpoint_name(path[:-1]) + ".gate_up_proj"
                sources[path] = Derived([fused], lambda w, first=first: np.split(w, 2, axis=1)[0 if first else 1],
                                        lambda s: (s[0], s[1] // 2, s[2]))
            else:
                sources[path] = Tensor(name if name in available else _saved_name(name))
        return sources

    @classmethod
    def checkpoint_tensors(cls, config: ModelConfig, params: dict) -> dict:
        """As save_pretrained writes them: experts fused (``gate_up_proj`` [E, 2I, H]), hub names."""
        fused = {path for path in params if len(path) >= 2 and path[-2] == "experts"
                 and path[-1] in ("gate_proj", "up_proj")}
        tensors = super().checkpoint_tensors(config, {p: v for p, v in params.items() if p not in fused})
        for prefix in {path[:-1] for path in fused}:
            tensors[cls.path_to_checkpoint_name(prefix) + ".gate_up_proj"] = np.concatenate(
                [params[(*prefix, "gate_proj")], params[(*prefix, "up_proj")]], axis=1)
        return tensors
