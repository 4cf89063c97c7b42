"""The decoder-only transformer every family composes: embeddings, layers, final norm, LM head.

A layer is three choices (``LayerSpec``): a **mixer** (GQA attention, MLA, gated DeltaNet, ...; each
in its own file under ``models/layers/``, declaring the cache it keeps), a **feed-forward** (a gated
MLP or an MoE block), and a **residual scheme** (``jaxinfer.models.residual``: how the stream runs
through the layer, what the mixer and feed-forward read and how their outputs are written back).
A family describes itself with a ``DecoderSpec`` built from its config; ``DecoderForCausalLM`` does
the rest. Families subclass it and implement ``spec``, plus ``checkpoint_sources`` where their
checkpoint layout differs from the parameter tree.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jaxinfer.cache.metadata import StepMetadata
from jaxinfer.cache.specs import CacheSpec
from jaxinfer.config import ModelConfig
from jaxinfer.kernels.math import rms_norm
from jaxinfer.models.base import CausalLM
from jaxinfer.models.layers import capture
from jaxinfer.models.layers.activations import get_activation
from jaxinfer.models.layers.linear import Embedding, Linear
from jaxinfer.models.layers.mlp import GatedMLP
from jaxinfer.models.layers.moe import MoESpec, SparseMoE
from jaxinfer.models.layers.norm import NormWeight, PreNormed, RMSNorm, SublayerInput
from jaxinfer.models.residual import LayerParts, PreNormResidual
from jaxinfer.sharding import local
from jaxinfer.sharding.plan import VOCAB

@dataclasses.dataclass(frozen=True)
class DenseMLP:
    """The gated MLP feed-forward; size and activation default to the config's."""

    bias: bool = False
    intermediate_size: int | None = None
    activation: str | None = None


@dataclasses.dataclass(frozen=True)
class NormStyle:
    """The RMSNorm flavour of a decoder's norms (``jaxinfer.kernels.math.rms_norm``)."""

    unit_offset: bool = False  # x * (1 + w) (Gemma, Qwen3-Next)
    float32_weight: bool = False  # the weight multiplied in float32 (GPT-OSS)


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    mixer: Any  # a mixer spec (GQA, MLA, ...): validate, cache_specs, rotary (or None) and module, of the config
    ffn: DenseMLP | MoESpec = DenseMLP()
    residual: Any = PreNormResidual()  # a scheme of jaxinfer.models.residual
    ffn_name: str = "mlp"  # the MLP / MoE block's module name in the checkpoint
    norm_eps: tuple[tuple[str, float], ...] = ()  # (norm name, eps) of norms not at rms_norm_eps (Muse Glimmer)


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    layers: tuple[LayerSpec, ...]
    norm: NormStyle = NormStyle()
    embed_scale: bool = False  # embeddings x sqrt(hidden_size), the factor rounded to the weight dtype (Gemma)
    embed_norm: bool = False  # embeddings through a weightless RMSNorm at rms_norm_eps (Muse Glimmer)
    placeholder_ids: tuple[int, ...] = ()  # embedded as token 0: image / video placeholders (HF's Muse Glimmer)
    final_norm: NormStyle | None = None  # the final norm's flavour where it is not the layers' (Muse Glimmer)
    logit_multiplier: float | None = None  # logits x this, before the soft-cap (Muse Glimmer)
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)

    def __post_init__(self):
        kinds = {type(layer.residual) for layer in self.layers}
        if len(kinds) > 1:
            raise ValueError(f"a decoder's layers hand one stream on: their residual schemes must be of one kind, "
                             f"got {sorted(k.__name__ for k in kinds)}")

    @property
    def residual(self):
        """The scheme that starts and finishes the stream (every layer's is of its kind)."""
        return self.layers[0].residual


def sliding_window(config: ModelConfig) -> int | None:
    """``sliding_window`` as HF's config class leaves it (None where the family turns it off), checked."""
    return config.int_field("sliding_window", default=None, ge=1)


def layer_windows(config: ModelConfig) -> tuple[int | None, ...]:
    """Sliding window per layer from ``layer_types``: ``sliding_window`` on its "sliding_attention"
    layers (none when the config leaves ``sliding_window`` unset, as HF's attention does), none
    on the others; no windows when ``layer_types`` is unset."""
    window = sliding_window(config)
    return tuple(window if t == "sliding_attention" else None for t in attention_layer_types(config))


def attention_layer_types(config: ModelConfig) -> tuple[str, ...]:
    """``layer_types`` of a softmax-attention decoder: "sliding_attention" or "full_attention" per
    layer, all full when unset."""
    return config.layer_kinds("layer_types", ("sliding_attention", "full_attention"), default="full_attention")


def mlp_layer_types(config: ModelConfig) -> tuple[str, ...]:
    """``mlp_layer_types``: "dense" or "sparse" per layer (HF's config classes fill it in)."""
    return config.layer_kinds("mlp_layer_types", ("dense", "sparse"))


class DecoderLayer(nn.Module):
    """One layer: its mixer and feed-forward, composed by its residual scheme. Takes the stream and
    the layer's cache, returns them updated."""

    config: ModelConfig
    spec: LayerSpec
    norm: NormStyle
    param_dtype: jnp.dtype

    def eps(self, name: str) -> float:
        """The RMSNorm ``name``'s epsilon: ``rms_norm_eps`` unless the layer spec gives its own."""
        return dict(self.spec.norm_eps).get(name, self.config.rms_norm_eps)

    def rms_norm(self, name: str) -> RMSNorm:
        return RMSNorm(self.eps(name), unit_offset=self.norm.unit_offset,
                       float32_weight=self.norm.float32_weight, param_dtype=self.param_dtype, name=name)

    def pre_normed(self, name: str, x, residual) -> PreNormed:
        """``x + residual`` and the RMSNorm ``name``, left for the sublayer's first projections."""
        init = "zeros" if self.norm.unit_offset else "ones"
        weight = NormWeight(x.shape[-1], self.param_dtype, init=init, name=name)()
        return PreNormed(x, residual, weight, self.eps(name), unit_offset=self.norm.unit_offset,
                         float32_weight=self.norm.float32_weight)

    def feed_forward(self, x: SublayerInput):
        c, ffn = self.config, self.spec.ffn
        if isinstance(ffn, DenseMLP):
            return GatedMLP(ffn.intermediate_size or c.intermediate_size, ffn.activation or c.hidden_act, ffn.bias,
                            self.param_dtype, name=self.spec.ffn_name)(x)
        return SparseMoE(ffn, c.hidden_act, self.param_dtype, name=self.spec.ffn_name)(x.normed())

    @nn.compact
    def __call__(self, stream, cache: dict, md, rotary, across_layers: dict | None = None):
        """-> (stream, cache). ``across_layers``: values of this forward that layers hand to later
        layers (a sparse-attention selection shared across layers); given to mixers that ask for it."""
        mixer = self.spec.mixer.module(self.config, self.param_dtype)
        if getattr(self.spec.mixer, "across_layers", False):
            mixer = functools.partial(mixer, across_layers=across_layers)
        parts = _Parts(self, lambda x: mixer(x, cache, md, rotary))
        stream = self.spec.residual.layer(parts, stream)
        return stream, parts.cache


class _Parts(LayerParts):
    """A ``DecoderLayer``'s parts for its scheme; keeps the cache its mixer returns."""

    def __init__(self, layer: DecoderLayer, mixer):
        self.layer, self.mixer, self.cache = layer, mixer, None

    def rms_norm(self, name: str, x):
        return self.layer.rms_norm(name)(x)

    def pre_normed(self, name: str, x, residual) -> PreNormed:
        return self.layer.pre_normed(name, x, residual)

    def mix(self, x: SublayerInput):
        out, self.cache = self.mixer(x)
        return out

    def feed_forward(self, x: SublayerInput):
        return self.layer.feed_forward(x)


class DecoderModel(nn.Module):
    """HF's ``model.*``: embeddings, layers, final norm. A research forward can have it record the
    hidden states (``capture.HIDDEN_STATES``): the layers' input, each layer's output (the stream as
    one hidden state: ``hidden`` of the residual scheme) and the final norm's output."""

    config: ModelConfig
    spec: DecoderSpec
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, token_ids, md: StepMetadata, caches):
        c = self.config
        embed = Embedding(c.vocab_size, c.hidden_size, self.param_dtype, name="embed_tokens")
        if self.spec.placeholder_ids:
            token_ids = jnp.where(jnp.isin(token_ids, jnp.asarray(self.spec.placeholder_ids)), 0, token_ids)
        x = embed(token_ids)
        if self.spec.embed_scale:  # HF rounds the factor to the weight dtype first
            x = x * jnp.asarray(c.hidden_size ** 0.5, self.param_dtype)
        if self.spec.embed_norm:
            x = rms_norm(x, jnp.ones((), x.dtype), c.rms_norm_eps)  # weightless: the normalised rows in x's dtype
        # Each distinct RoPE the layers need, computed once per step.
        seq_len_of_token = md.seq_lens[md.token_seq_ids]
        tables = {}
        for layer in self.spec.layers:
            rotary = layer.mixer.rotary(c)
            if rotary is not None and rotary not in tables:
                tables[rotary] = rotary.cos_sin(md.positions, seq_len_of_token)
        hidden_states = capture.wanted(self, capture.HIDDEN_STATES)
        if hidden_states:
            capture.record(self, capture.HIDDEN_STATES, "embeddings", x)
        scheme = self.spec.residual
        new_caches, stream, across_layers = [], scheme.start(x), {}
        for i, layer in enumerate(self.spec.layers):
            rotary = layer.mixer.rotary(c)
            stream, cache = DecoderLayer(c, layer, self.spec.norm, self.param_dtype, name=f"layers_{i}")(
                stream, caches[i], md, tables.get(rotary), across_layers)
            new_caches.append(cache)
            if hidden_states:
                capture.record(self, capture.HIDDEN_STATES, "layer_outputs", scheme.hidden(stream))
        style = self.spec.final_norm or self.spec.norm
        final_norm = RMSNorm(c.rms_norm_eps, unit_offset=style.unit_offset, float32_weight=style.float32_weight,
                             param_dtype=self.param_dtype, name="norm")
        x = scheme.finish(stream, final_norm)
        if hidden_states:
            capture.record(self, capture.HIDDEN_STATES, "final", x)
        return x, embed, new_caches


class DecoderForCausalLM(CausalLM):
    """Base of every decoder family; subclasses provide ``spec``."""

    @classmethod
    def spec(cls, config: ModelConfig) -> DecoderSpec:
        raise NotImplementedError

    @classmethod
    def validate_config(cls, config: ModelConfig) -> None:
        get_activation(config.hidden_act)
        for layer in cls.spec(config).layers:
            layer.mixer.validate(config)
            rotary = layer.mixer.rotary(config)
            if rotary is not None:
                rotary.rope.check_rotary_dim(rotary.head_dim)

    @classmethod
    def cache_specs(cls, config: ModelConfig) -> tuple[tuple[CacheSpec, ...], ...]:
        return tuple(layer.mixer.cache_specs(config) for layer in cls.spec(config).layers)

    @classmethod
    def skipped_checkpoint_keys_for(cls, config: ModelConfig) -> tuple[tuple[str, str], ...]:
        # Multimodal checkpoints: the text model is served; vision input is not supported yet.
        return ((r"^(model\.)?(vision_tower|vision_model|visual|mm_projector|multi_modal_projector)\.",
                 "the vision tower and projector (text input only)"),)

    @classmethod
    def ties_lm_head(cls, config: ModelConfig) -> bool:
        """Whether the LM head is the embedding matrix (``tie_word_embeddings``)."""
        return config.tie_word_embeddings

    @classmethod
    def ignored_checkpoint_keys_for(cls, config: ModelConfig) -> tuple[str, ...]:
        # A tied LM head reads the embedding matrix; a stored copy is ignored, as HF does.
        tied = (r"^lm_head\.weight$",) if cls.ties_lm_head(config) else ()
        return cls.ignored_checkpoint_keys + tied

    @nn.compact
    def __call__(self, token_ids, md: StepMetadata, caches, *, all_logits: bool = False):
        """Returns float32 logits for ``md.logits_indices`` (or every token with ``all_logits``)."""
        c = self.config
        spec = type(self).spec(c)
        x, embed, caches = DecoderModel(c, spec, self.dtype, name="model")(token_ids, md, caches)
        if not all_logits:
            x = x[md.logits_indices]
        if type(self).ties_lm_head(c):
            logits = embed.attend(x)
        else:  # vocabulary-parallel: each device's block of logits, then all of them on every device
            logits = local.gather(Linear(c.vocab_size, False, self.dtype, (VOCAB, None), name="lm_head")(x), VOCAB)
        if spec.logit_multiplier is not None:  # in float32, rounded once, as torch multiplies by a float
            logits = (logits.astype(jnp.float32) * spec.logit_multiplier).astype(logits.dtype)
        cap = spec.final_logit_softcap
        if cap:
            logits = jnp.tanh(logits / cap) * cap  # in the logits' dtype, as HF
        return logits.astype(jnp.float32), caches
