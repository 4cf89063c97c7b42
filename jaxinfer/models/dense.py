"""Dense decoder-only transformers: Llama, Mistral, Qwen2 and Qwen3 in one implementation.

The four differ only in switches that ``DenseVariant`` reads from the config: biases on q/k/v and o,
per-head q/k RMSNorm (Qwen3), and which layers use a sliding window (Mistral: all of them when
``sliding_window`` is set; Qwen2/3: ``layer_types``, or layers ``>= max_window_layers`` when
``use_sliding_window``).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from jaxinfer.cache.layout import KVCacheSpec
from jaxinfer.cache.metadata import AttentionMetadata
from jaxinfer.config import ModelConfig
from jaxinfer.errors import ConfigError
from jaxinfer.models.base import CausalLM
from jaxinfer.models.layers.activations import get_activation
from jaxinfer.models.layers.attention import PagedGQAttention
from jaxinfer.models.layers.linear import Embedding, Linear
from jaxinfer.models.layers.mlp import GatedMLP
from jaxinfer.models.layers.norm import RMSNorm
from jaxinfer.models.layers.rope import RotaryEmbedding


@dataclasses.dataclass(frozen=True)
class DenseVariant:
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    layer_windows: tuple[int | None, ...]  # sliding window per layer, None for full attention

    @classmethod
    def from_config(cls, config: ModelConfig) -> "DenseVariant":
        kind = config.model_type
        n = config.num_hidden_layers
        window = config.get("sliding_window")
        if kind == "mistral":
            windows = (window,) * n
        elif kind in ("qwen2", "qwen3"):
            layer_types = config.get("layer_types")
            if layer_types is None:
                use = config.get("use_sliding_window", False) and window is not None
                start = config.get("max_window_layers", n)
                layer_types = ["sliding_attention" if use and i >= start else "full_attention" for i in range(n)]
            if len(layer_types) != n:
                raise ConfigError(f"layer_types has {len(layer_types)} entries for {n} layers")
            unknown = set(layer_types) - {"sliding_attention", "full_attention"}
            if unknown:
                raise ConfigError(f"unsupported layer_types {sorted(unknown)} for {kind}")
            if "sliding_attention" in layer_types and not window:
                raise ConfigError("layer_types has sliding_attention layers but sliding_window is not set")
            windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        else:
            windows = (None,) * n
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            qkv_bias=True if kind == "qwen2" else attention_bias,
            o_bias=False if kind == "qwen2" else attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)) if kind == "llama" else False,
            qk_norm=kind == "qwen3",
            layer_windows=windows,
        )


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class DecoderLayer(nn.Module):
    config: ModelConfig
    variant: DenseVariant
    layer_index: int
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, cos, sin, kv_cache, md):
        c, v = self.config, self.variant
        norm = lambda name: RMSNorm(c.rms_norm_eps, param_dtype=self.param_dtype, name=name)  # noqa: E731
        attn_out, kv_cache = PagedGQAttention(
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            qkv_bias=v.qkv_bias,
            o_bias=v.o_bias,
            qk_norm_eps=c.rms_norm_eps if v.qk_norm else None,
            sliding_window=v.layer_windows[self.layer_index],
            param_dtype=self.param_dtype,
            name="self_attn",
        )(norm("input_layernorm")(x), cos, sin, kv_cache, md)
        x = x + attn_out
        mlp = GatedMLP(c.intermediate_size, c.hidden_act, v.mlp_bias, self.param_dtype, name="mlp")
        x = x + mlp(norm("post_attention_layernorm")(x))
        return x, kv_cache


class DecoderModel(nn.Module):
    """HF's ``model.*``: embeddings, layers, final norm."""

    config: ModelConfig
    variant: DenseVariant
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, token_ids, md: AttentionMetadata, caches):
        c = self.config
        embed = Embedding(c.vocab_size, c.hidden_size, self.param_dtype, name="embed_tokens")
        x = embed(token_ids)
        rope = RotaryEmbedding(c.rope, c.head_dim, c.max_position_embeddings)
        cos, sin = rope.cos_sin(md.positions, md.seq_lens[md.token_seq_ids])
        new_caches = []
        for i in range(c.num_hidden_layers):
            x, kv = DecoderLayer(c, self.variant, i, self.param_dtype, name=f"layers_{i}")(x, cos, sin, caches[i], md)
            new_caches.append(kv)
        x = RMSNorm(c.rms_norm_eps, param_dtype=self.param_dtype, name="norm")(x)
        return x, embed, new_caches


class DenseDecoderForCausalLM(CausalLM):
    """Llama / Mistral / Qwen2 / Qwen3 (``*ForCausalLM``)."""

    @classmethod
    def validate_config(cls, config: ModelConfig) -> None:
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {config.model_type!r} is not a dense family this class serves "
                f"({', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        get_activation(config.hidden_act)
        DenseVariant.from_config(config)

    @classmethod
    def kv_cache_specs(cls, config: ModelConfig) -> tuple[KVCacheSpec, ...]:
        return tuple(
            KVCacheSpec(
                kind="sliding_attention" if w else "full_attention",
                num_kv_heads=config.num_key_value_heads,
                head_dim=config.head_dim,
                sliding_window=w,
            )
            for w in DenseVariant.from_config(config).layer_windows
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
        variant = DenseVariant.from_config(c)
        x, embed, caches = DecoderModel(c, variant, self.dtype, name="model")(token_ids, md, caches)
        if not all_logits:
            x = x[md.logits_indices]
        if c.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = Linear(c.vocab_size, False, self.dtype, name="lm_head")(x)
        return logits.astype(jnp.float32), caches
