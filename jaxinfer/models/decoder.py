"""The decoder-only transformer every family composes: embeddings, layers of (attention, MLP or MoE)
with pre-norm residuals, final norm, LM head.

A family describes itself with a ``DecoderSpec`` built from its config (which biases, which q/k
norm, sinks, which layers slide, which layers are sparse and how they route); ``DecoderForCausalLM``
does the rest. Families subclass it and implement ``spec``, plus ``checkpoint_sources`` where their
checkpoint layout differs from the parameter tree.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from jaxinfer.cache.layout import KVCacheSpec
from jaxinfer.cache.metadata import AttentionMetadata
from jaxinfer.config import ModelConfig
from jaxinfer.errors import ConfigError
from jaxinfer.kernels.moe import flag_words
from jaxinfer.models.base import CausalLM
from jaxinfer.models.layers.activations import get_activation
from jaxinfer.models.layers.attention import PagedGQAttention
from jaxinfer.models.layers.linear import Embedding, Linear
from jaxinfer.models.layers.mlp import GatedMLP
from jaxinfer.models.layers.moe import MoESpec, SparseMoE
from jaxinfer.models.layers.norm import NormWeight, PreNorm, RMSNorm
from jaxinfer.models.layers.rope import RotaryEmbedding


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None  # None, "head" or "full" (see PagedGQAttention)
    sinks: bool = False
    sliding_window: int | None = None


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    attention: AttentionSpec
    moe: MoESpec | None = None  # None: a dense gated MLP
    mlp_bias: bool = False
    mlp_name: str = "mlp"  # the MLP / MoE block's module name in the checkpoint


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    layers: tuple[LayerSpec, ...]
    norm_float32_weight: bool = False  # RMSNorm multiplies its weight in float32 (GPT-OSS)


def sliding_window(config: ModelConfig) -> int | None:
    """``sliding_window`` as HF's config class leaves it (None where the family turns it off), checked."""
    return config.int_field("sliding_window", default=None, ge=1)


def layer_windows(config: ModelConfig) -> tuple[int | None, ...]:
    """Sliding window per layer from ``layer_types``: ``sliding_window`` on its "sliding_attention"
    layers (none when the config leaves ``sliding_window`` unset, as HF's attention does), none
    on the others; no windows when ``layer_types`` is unset."""
    n, window = config.num_hidden_layers, sliding_window(config)
    layer_types = config.get("layer_types")
    if layer_types is None:
        return (None,) * n
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != n:
        raise ConfigError(f"layer_types must list one entry per layer ({n}), got {layer_types!r}")
    unknown = sorted({repr(t) for t in layer_types if t not in ("sliding_attention", "full_attention")})
    if unknown:
        raise ConfigError(f"layer_types holds {unknown}; {config.model_type} layers are 'sliding_attention' or "
                          "'full_attention'")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


class DecoderLayer(nn.Module):
    """One pre-norm block. It takes the previous block's output and the residual stream separately
    (``residual=None`` for the first layer) and returns them the same way, so each residual add is
    fused with the RMSNorm after it: HF's ``x = residual + out; norm(x)`` in one op
    (``RMSNorm(x, residual)``), and where the norm feeds several projections (q/k/v, a dense MLP's
    gate/up), in one op with them (``PreNorm``)."""

    config: ModelConfig
    spec: LayerSpec
    norm_float32_weight: bool
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, residual, cos, sin, kv_cache, md, flag=None):
        """-> (x, residual, kv_cache, flag). ``flag``: the flag words of a one-token MoE block kernel
        (``jaxinfer.kernels.moe.flag_words``), handed from layer to layer."""
        c, spec, attn = self.config, self.spec, self.spec.attention

        def pre_norm(name, residual):  # applied by the projections after it, in one op with them
            weight = NormWeight(x.shape[-1], self.param_dtype, name=name)()
            return PreNorm(residual, weight, c.rms_norm_eps, float32_weight=self.norm_float32_weight)

        attention = PagedGQAttention(
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            qkv_bias=attn.qkv_bias,
            o_bias=attn.o_bias,
            qk_norm_eps=c.rms_norm_eps if attn.qk_norm else None,
            qk_norm=attn.qk_norm or "head",
            sinks=attn.sinks,
            sliding_window=attn.sliding_window,
            param_dtype=self.param_dtype,
            name="self_attn",
        )
        attn_out, kv_cache, residual = attention(x, cos, sin, kv_cache, md, pre_norm("input_layernorm", residual))
        if spec.moe is None:
            mlp = GatedMLP(c.intermediate_size, c.hidden_act, spec.mlp_bias, self.param_dtype, name=spec.mlp_name)
            out, residual = mlp(attn_out, pre_norm("post_attention_layernorm", residual))
            return out, residual, kv_cache, flag
        moe = SparseMoE(spec.moe, c.hidden_act, self.param_dtype, name=spec.mlp_name)
        if SparseMoE.takes_whole_block(spec.moe, attn_out.shape[0]) and not self.norm_float32_weight:
            # One token: the add, the norm, the block and the residual add after it as one op (one
            # kernel on the GPU where it fits), its hand-off words flagged per call and layer. Its
            # output is the whole residual stream: the next layer adds nothing to it.
            weight = NormWeight(x.shape[-1], self.param_dtype, name="post_attention_layernorm")()
            stream, flag = moe(attn_out, block=(residual, weight, c.rms_norm_eps, flag))
            return stream, None, kv_cache, flag
        # Otherwise the router is a single projection, which stays XLA's after the add + norm kernel.
        # Folding the norm into the routing kernel, the gate + up kernel or the router's projection
        # kernel measured slower (docs/performance.md).
        h, residual = RMSNorm(c.rms_norm_eps, float32_weight=self.norm_float32_weight, param_dtype=self.param_dtype,
                              name="post_attention_layernorm")(attn_out, residual)
        return moe(h), residual, kv_cache, flag


class DecoderModel(nn.Module):
    """HF's ``model.*``: embeddings, layers, final norm."""

    config: ModelConfig
    spec: DecoderSpec
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, token_ids, md: AttentionMetadata, caches):
        c = self.config
        embed = Embedding(c.vocab_size, c.hidden_size, self.param_dtype, name="embed_tokens")
        x = embed(token_ids)
        rope = RotaryEmbedding(c.rope, c.head_dim, c.max_position_embeddings)
        cos, sin = rope.cos_sin(md.positions, md.seq_lens[md.token_seq_ids])
        new_caches, residual = [], None
        # A one-token MoE block kernel's flag: unique to each layer of each call (the step id times
        # the layer count, plus one per layer that used it).
        flag = None if md.step_id is None else flag_words(md.step_id * len(self.spec.layers))
        for i, layer in enumerate(self.spec.layers):
            x, residual, kv, flag = DecoderLayer(c, layer, self.spec.norm_float32_weight, self.param_dtype,
                                                 name=f"layers_{i}")(x, residual, cos, sin, caches[i], md, flag)
            new_caches.append(kv)
        final_norm = RMSNorm(c.rms_norm_eps, float32_weight=self.spec.norm_float32_weight,
                             param_dtype=self.param_dtype, name="norm")
        x = final_norm(x) if residual is None else final_norm(x, residual)[0]
        return x, embed, new_caches


class DecoderForCausalLM(CausalLM):
    """Base of every decoder family; subclasses provide ``spec``."""

    @classmethod
    def spec(cls, config: ModelConfig) -> DecoderSpec:
        raise NotImplementedError

    @classmethod
    def validate_config(cls, config: ModelConfig) -> None:
        get_activation(config.hidden_act)
        config.rope.check_rotary_dim(config.head_dim)
        cls.spec(config)

    @classmethod
    def kv_cache_specs(cls, config: ModelConfig) -> tuple[KVCacheSpec, ...]:
        return tuple(
            KVCacheSpec(
                kind="sliding_attention" if layer.attention.sliding_window else "full_attention",
                num_kv_heads=config.num_key_value_heads,
                head_dim=config.head_dim,
                sliding_window=layer.attention.sliding_window,
            )
            for layer in cls.spec(config).layers
        )

    @classmethod
    def ignored_checkpoint_keys_for(cls, config: ModelConfig) -> tuple[str, ...]:
        # A tied LM head reads the embedding matrix; a stored copy is ignored, as HF does.
        tied = (r"^lm_head\.weight$",) if config.tie_word_embeddings else ()
        return cls.ignored_checkpoint_keys + tied

    @nn.compact
    def __call__(self, token_ids, md: AttentionMetadata, caches, *, all_logits: bool = False):
        """Returns float32 logits for ``md.logits_indices`` (or every token with ``all_logits``)."""
        c = self.config
        x, embed, caches = DecoderModel(c, type(self).spec(c), self.dtype, name="model")(token_ids, md, caches)
        if not all_logits:
            x = x[md.logits_indices]
        if c.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = Linear(c.vocab_size, False, self.dtype, name="lm_head")(x)
        return logits.astype(jnp.float32), caches
