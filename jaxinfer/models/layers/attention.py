"""The GQA attention mixer: grouped-query self-attention over the paged KV cache (full or sliding
window). ``GQA`` is the layer's choice of it (what the family's config sets) and declares the cache
the layer keeps; ``PagedGQAttention`` is the module."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.cache import fp8
from jaxinfer.cache.metadata import StepMetadata
from jaxinfer.cache.specs import PagedKV
from jaxinfer.errors import ConfigError
from jaxinfer.kernels import attention as attention_ops
from jaxinfer.kernels.attention import reference as attention_reference
from jaxinfer.kernels.math import rms_norm
from jaxinfer.models.layers import capture
from jaxinfer.models.layers.linear import Linear, LinearParams
from jaxinfer.models.layers.norm import NormWeight, RMSNorm, SublayerInput
from jaxinfer.models.layers.rope import RotaryEmbedding
from jaxinfer.sharding import local
from jaxinfer.sharding.plan import HEADS, KV_HEADS


@dataclasses.dataclass(frozen=True)
class GQA:
    """A GQA attention mixer as a family configures it; heads, head_dim and RoPE come from the config."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None  # None, "head" or "full" (see PagedGQAttention)
    qk_norm_unit_offset: bool = False  # q/k norms are x * (1 + w) (Gemma)
    sinks: bool = False
    sliding_window: int | None = None
    scale: float | None = None  # softmax scale; default head_dim ** -0.5
    output_gate: bool = False  # q_proj gives per head [q | gate]; out * sigmoid(gate) before o_proj (Qwen3-Next)
    gate_proj: bool = False  # out * sigmoid(gate_proj(x)) elementwise before o_proj, no bias (Muse Glimmer)
    qk_norm_weight: bool = True  # False: the q/k norms have no weight (Muse Glimmer)
    query_multiplier: float | None = None  # q times this after its norm, before RoPE (Muse Glimmer)
    use_rope: bool = True  # False: a NoPE layer, no rotary embedding at all
    rope_layer_type: str | None = None  # whose RoPE, where rope_parameters are given per layer type
    name: str = "self_attn"  # the module's name in the checkpoint
    captures = (capture.ATTENTIONS,)  # what the layer records for a research forward

    def cache_specs(self, config) -> tuple[PagedKV, ...]:
        return (PagedKV(config.num_key_value_heads, config.head_dim, self.sliding_window),)

    def validate(self, config) -> None:
        """``ConfigError`` for head counts GQA cannot group: KV head j serves a block of query heads."""
        if config.num_attention_heads % config.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({config.num_key_value_heads})")

    def rotary(self, config) -> RotaryEmbedding | None:
        if not self.use_rope:
            return None
        return RotaryEmbedding(config.rope_for(self.rope_layer_type), config.head_dim, config.max_position_embeddings)

    def module(self, config, param_dtype) -> "PagedGQAttention":
        return PagedGQAttention(
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
            qkv_bias=self.qkv_bias, o_bias=self.o_bias, qk_norm_eps=config.rms_norm_eps if self.qk_norm else None,
            qk_norm=self.qk_norm or "head", qk_norm_unit_offset=self.qk_norm_unit_offset, sinks=self.sinks,
            sliding_window=self.sliding_window, scale=self.scale, output_gate=self.output_gate,
            gate_proj=self.gate_proj, qk_norm_weight=self.qk_norm_weight, query_multiplier=self.query_multiplier,
            param_dtype=param_dtype, name=self.name)


class PagedGQAttention(nn.Module):
    """[The block's residual add + RMSNorm +] q/k/v projections (one op) -> optional q/k RMSNorm -> RoPE ->
    cache write -> attention (optional sliding window and sinks) -> o_proj. A per-head q/k norm, RoPE
    and the cache write are one op (``rotary_cache_write``); at a decode step, attention joins them
    (``rotary_paged_decode_attention``).

    KV head ``j`` serves query heads ``[j*g, (j+1)*g)`` (HF's ``repeat_kv``), ``g = heads // kv_heads``.
    With ``output_gate``, ``q_proj`` gives ``[q_h | gate_h]`` per head and the attention output is
    multiplied by ``sigmoid(gate)`` before ``o_proj``; with ``gate_proj``, the gate is a projection of
    its own, projected in the same op as q, k and v. ``qk_norm_weight=False``: weightless per-head q/k
    norms; ``query_multiplier`` then scales the normed q (before RoPE, rounded once, as HF's).
    ``rotary=None`` (a NoPE layer): q and k are not rotated.

    Tensor-parallel by head: each device projects, caches and attends its query heads and the KV
    heads they read (q/k/v column-parallel, o_proj row-parallel); with fewer KV heads than devices,
    each KV head is held by the devices whose query heads read it (``jaxinfer.sharding.plan``).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm_eps: float | None = None  # q/k RMSNorm before RoPE
    qk_norm: str = "head"  # "head": per head, weight [head_dim] (Qwen3); "full": over all heads (MiniMax-M2)
    qk_norm_unit_offset: bool = False  # (1 + w) q/k norms, applied before the fused RoPE op (Gemma)
    sinks: bool = False  # one learned softmax logit per head (GPT-OSS)
    sliding_window: int | None = None
    scale: float | None = None  # default head_dim ** -0.5
    output_gate: bool = False
    gate_proj: bool = False
    qk_norm_weight: bool = True
    query_multiplier: float | None = None
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: SublayerInput, cache: dict, md: StepMetadata, rotary: tuple):
        """``x``: the block's input (its pending norm folded into the q/k/v op); ``cache``: {"k", "v"};
        ``rotary``: (cos, sin) of this mixer's RoPE, None for none. -> (output, the updated cache)."""
        t = x.shape[0]
        heads, kv_heads = local.local(self.num_heads, HEADS), local.local(self.num_kv_heads, KV_HEADS)
        q_size = heads * self.head_dim  # this device's
        q_width = 2 * self.num_heads * self.head_dim if self.output_gate else self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        projections = ((q_width, HEADS, "q_proj", self.qkv_bias), (kv_width, KV_HEADS, "k_proj", self.qkv_bias),
                       (kv_width, KV_HEADS, "v_proj", self.qkv_bias))
        if self.gate_proj:
            projections += ((self.num_heads * self.head_dim, HEADS, "gate_proj", False),)
        params = [LinearParams(n, bias, self.param_dtype, (axis, None), name=name)(x.shape[-1])
                  for n, axis, name, bias in projections]
        # One op for all (one launch at decode, with the block's norm), weights kept apart as the
        # checkpoint has them.
        weights, biases = [w for w, _ in params], [b for _, b in params]
        q, k, v, *gate = x.project(weights, biases)
        gate = gate[0] if gate else None
        if self.output_gate:
            q_and_gate = q.reshape(t, heads, 2, self.head_dim)
            q, gate = q_and_gate[:, :, 0].reshape(t, q_size), q_and_gate[:, :, 1].reshape(t, q_size)
        v = v.reshape(t, kv_heads, self.head_dim)
        norm = lambda name, axis=None: RMSNorm(self.qk_norm_eps, unit_offset=self.qk_norm_unit_offset,  # noqa: E731
                                               param_dtype=self.param_dtype, axis=axis, name=name)
        norms = {}
        if self.qk_norm_eps is not None and self.qk_norm == "full":  # over all heads: every device's piece
            q, k = norm("q_norm", HEADS)(q), norm("k_norm", KV_HEADS)(k)
        q = q.reshape(t, heads, self.head_dim)
        k = k.reshape(t, kv_heads, self.head_dim)
        if self.qk_norm_eps is not None and self.qk_norm == "head" and self.qk_norm_unit_offset:
            q, k = norm("q_norm")(q), norm("k_norm")(k)  # per head; the fused op's norm is plain-weight
        elif self.qk_norm_eps is not None and self.qk_norm == "head":
            if self.qk_norm_weight:
                q_norm = NormWeight(self.head_dim, self.param_dtype, name="q_norm")()
                k_norm = NormWeight(self.head_dim, self.param_dtype, name="k_norm")()
            else:  # weightless: the normalised rows in q's dtype
                q_norm = k_norm = jnp.ones((), q.dtype)
            if rotary is not None and self.qk_norm_weight and self.query_multiplier is None:  # in the RoPE op
                norms = dict(q_norm=q_norm, k_norm=k_norm, norm_eps=self.qk_norm_eps)
            else:
                q, k = rms_norm(q, q_norm, self.qk_norm_eps), rms_norm(k, k_norm, self.qk_norm_eps)
        if self.query_multiplier is not None:  # in float32, rounded once, as torch multiplies by a float
            q = (q.astype(jnp.float32) * self.query_multiplier).astype(q.dtype)
        options = dict(scale=self.scale or self.head_dim**-0.5, sliding_window=self.sliding_window)
        if self.sinks:
            options["sinks"] = local.param(self, "sinks", nn.initializers.normal(0.02), (self.num_heads,), (HEADS,),
                                           self.param_dtype)
        k_scale, v_scale = fp8.scales_of(cache, "k", "v")
        scales = {} if k_scale is None else dict(k_scale=k_scale, v_scale=v_scale)  # an fp8 cache's
        options.update(scales)
        if rotary is None:  # NoPE: the cache write alone before attention
            k_cache, v_cache = attention_ops.write_kv_cache(cache["k"], cache["v"], k, v, md.slot_mapping, **scales)
            if md.decode:
                out = attention_ops.paged_decode_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens,
                                                           **options)
        elif md.decode:  # one op: on the GPU the attention kernel also normalises, rotates and writes the cache
            out, k_cache, v_cache = attention_ops.rotary_paged_decode_attention(
                q, k, v, *rotary, cache["k"], cache["v"], md.slot_mapping, md.block_tables, md.seq_lens, **norms,
                **options)
        else:
            q, k_cache, v_cache = attention_ops.rotary_cache_write(q, k, v, *rotary, cache["k"], cache["v"],
                                                                   md.slot_mapping, **norms, **scales)
        if not md.decode:
            out = attention_ops.ragged_paged_attention(q, k_cache, v_cache, md.positions, md.token_seq_ids,
                                                       md.block_tables, md.seq_lens, **options)
            if capture.wanted(self, capture.ATTENTIONS):
                probs = attention_reference.ragged_attention_probs(q, k_cache, md.positions, md.token_seq_ids,
                                                                   md.block_tables, md.seq_lens, **options)
                capture.record(self, capture.ATTENTIONS, "probs", local.gather(probs, HEADS, axis=1))
        out = out.reshape(t, q_size)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate)
        out = Linear(x.shape[-1], self.o_bias, self.param_dtype, (None, HEADS), name="o_proj")(out)
        return out, {**cache, "k": k_cache, "v": v_cache}
