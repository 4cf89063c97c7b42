"""The MLA mixer: multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache.

q = q_b(RMSNorm(q_a(x))) (or q_proj(x) without a q LoRA), per head ``[nope | rope]``; kv_a(x) =
``[latent (kv_lora_rank) | k_rope (qk_rope_head_dim)]``, the latent RMS-normalised, k_rope one head
shared by all. The cache keeps only ``[latent | rotated k_rope]`` per token (``PagedLatent``).
Attention runs in absorbed form, for prefill chunks and decode alike: ``q_nope`` goes through W_UK
(kv_b's key rows) into the latent space, scores are ``q_latent . latent + q_rope . k_rope``, the
output is a sum of latents, and W_UV (kv_b's value rows) maps it to each head's values. One code path
then reads cached pages for chunked prefill and decode; the expanded form (keys and values per head
from kv_b, fewer FLOPs per key at long prompts) is left to a GPU prefill kernel.
The latent and q_a norms use eps 1e-6 whatever ``rms_norm_eps`` says, as HF does. With
``output_gate`` (Bailing-MoE-V3) each head's output is scaled by ``sigmoid(g_proj(x))``, one gate per
head (computed in float32, rounded to the serving dtype), before o_proj; with ``value_gate`` (HY-V4)
by ``sigmoid(gate_proj(x))``, one gate per value dim of each head (in the serving dtype, as HF).
With ``sinks`` (HY-V4) each head has a learned float32 logit that joins its softmax as an extra
column and is dropped (GPT-OSS's attention sinks); the Pallas kernels refuse such calls, so the
reference (dense) and the tiled path (sparse) serve them.

With an ``Indexer`` (DeepSeek sparse attention: DeepSeek-V3.2, GLM-5) the layer also keeps one
indexer key per token (a ``PagedSide`` cache) and each token attends only to the ``top_k`` cached
tokens its indexer scores best (``jaxinfer.kernels.sparse_mla``): the indexer's queries come from
the normed q latent through ``wq_b``, its key from the block's normed input through ``wk`` and a
LayerNorm, both rotated over their first ``qk_rope_head_dim`` dims (HY-V4: the last, ``rope_last``);
its per-head weights from ``weights_proj`` (kept in float32, as HF keeps it) times ``num_heads ** -0.5``
(HY-V4, ``scale_in_weights``: times ``head_dim ** -0.5`` too, in place of scaling each head's q.k, as
HF rounds it). A layer that ``shares_selection`` (GLM-5's and HY-V4's "shared" layers) has no indexer
and attends to the last indexer layer's selection, handed on through the forward's ``across_layers``
values.

Tensor-parallel by head, the latent replicated (``docs/sharding-mla.md``): q_a / kv_a, their norms
and the latent cache are whole on every device (each computes and writes the same latent rows);
q_b (or q_proj) and kv_b are column-parallel by head (kv_b's rows are ``[k_nope | v]`` per head, so
a contiguous split keeps each head's W_UK and W_UV together); the absorbed attention runs on the
device's heads and o_proj is row-parallel, one sum per layer. The indexer stays replicated: its
heads' weighted scores are summed before one top-k shared by all heads, so splitting them would add
a sum of ``[T, keys]`` scores over the devices, and its rounding could change the selection.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.cache import fp8
from jaxinfer.cache.metadata import StepMetadata
from jaxinfer.cache.specs import PagedLatent, PagedSide
from jaxinfer.errors import ConfigError
from jaxinfer.kernels import linear as linear_ops
from jaxinfer.kernels import mla as mla_ops
from jaxinfer.kernels import sparse_mla as sparse_ops
from jaxinfer.kernels.math import apply_rotary, apply_rotary_interleaved
from jaxinfer.models.layers import capture
from jaxinfer.models.layers.attention_probs import latent_attention_probs
from jaxinfer.models.layers.linear import Linear, LinearParams
from jaxinfer.models.layers.norm import LayerNorm, RMSNorm, SublayerInput
from jaxinfer.models.layers.rope import RotaryEmbedding
from jaxinfer.quantization import as_array
from jaxinfer.sharding import local
from jaxinfer.sharding.plan import HEADS

LATENT_NORM_EPS = 1e-6  # HF's q_a_layernorm and kv_a_layernorm: hard-coded, not rms_norm_eps
INDEXER_KEY_NORM_EPS = 1e-6  # HF's indexer k_norm (a LayerNorm): hard-coded too
SELECTION = "sparse_selection"  # the across-layers key of the last indexer's selection


def _rotate_interleaved_prefix(x, cos, sin):
    """Interleaved RoPE over the first ``cos.shape[-1]`` dims of ``x`` [T, heads, d]; the rest pass."""
    rotary_dim = cos.shape[-1]
    rotated = apply_rotary_interleaved(x[..., :rotary_dim], cos, sin)
    return jnp.concatenate([rotated, x[..., rotary_dim:]], axis=-1) if x.shape[-1] > rotary_dim else rotated


def _rotate_suffix(x, cos, sin):
    """rotate_half RoPE over the last ``cos.shape[-1]`` dims of ``x`` [T, heads, d]; the rest pass."""
    rotary_dim = cos.shape[-1]
    rotated = apply_rotary(x[..., -rotary_dim:], cos, sin)
    return jnp.concatenate([x[..., :-rotary_dim], rotated], axis=-1) if x.shape[-1] > rotary_dim else rotated


@dataclasses.dataclass(frozen=True)
class Indexer:
    """DeepSeek sparse attention's lightning indexer: ``num_heads`` heads of ``head_dim``, ``top_k``
    keys kept per query token."""

    num_heads: int
    head_dim: int
    top_k: int
    rope_interleave: bool = False  # DeepSeek-V3.2: rotate_half over the first rope dims; GLM-5: interleaved pairs
    rope_last: bool = False  # rotate_half over the last rope dims instead of the first (HY-V4)
    key_norm_eps: float = INDEXER_KEY_NORM_EPS  # the key LayerNorm's eps (HY-V4: rms_norm_eps)
    key_norm_float32: bool = False  # the key LayerNorm's weights kept in float32 (HY-V4)
    scale_in_weights: bool = False  # head_dim ** -0.5 folded into the head weights, not each q.k (HY-V4)

    def __post_init__(self):
        if self.rope_last and self.rope_interleave:
            raise ConfigError("the indexer rotates its last rope dims with rotate_half only, not interleaved pairs")


@dataclasses.dataclass(frozen=True)
class MLA:
    """An MLA mixer as a family configures it; the head count and RoPE come from the config."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: q_proj straight from the hidden state
    attention_bias: bool = False  # biases on q_a_proj, kv_a_proj_with_mqa and o_proj (as HF; never on q_proj)
    rope_interleave: bool = True  # RoPE over interleaved pairs (DeepSeek), else rotate_half
    use_rope: bool = True  # False: NoPE (the k_rope slice is kept but never rotated)
    softmax_scale: float | None = None  # default (qk_nope + qk_rope) ** -0.5
    indexer: Indexer | None = None  # DeepSeek sparse attention
    shares_selection: bool = False  # sparse attention over the previous layer's selection, no indexer (GLM-5)
    output_gate: bool = False  # each head's output times sigmoid(g_proj(x)[head]) (Bailing-MoE-V3)
    value_gate: bool = False  # each head's values times sigmoid(gate_proj(x)[head, :]) (HY-V4)
    sinks: bool = False  # a learned float32 softmax logit per head (HY-V4)
    name: str = "self_attn"

    @property
    def across_layers(self) -> bool:
        """Whether the layer hands a sparse-attention selection to the layers after it, or takes one."""
        return self.indexer is not None or self.shares_selection

    @property
    def captures(self) -> tuple[str, ...]:
        """What the layer records for a research forward; not its attention probabilities with sinks,
        which ``attention_probs.latent_attention_probs`` leaves out of its softmax."""
        attentions = () if self.sinks else (capture.ATTENTIONS,)
        return attentions + (capture.INDEXER,) if self.indexer is not None else attentions

    def validate(self, config) -> None:
        """The gates' and the indexer's constraints (its queries come from the q latent; it rotates
        ``qk_rope_head_dim`` of its dims); the sizes are checked as the family reads them."""
        if self.output_gate and self.value_gate:
            raise ConfigError("an MLA layer's output gate is per head (g_proj) or per value dim (gate_proj), not both")
        if self.indexer is not None and self.shares_selection:
            raise ConfigError("a sparse-attention layer either runs its indexer or shares the previous layer's "
                              "selection, not both")
        if self.indexer is None:
            return
        if not self.q_lora_rank:
            raise ConfigError("sparse attention's indexer reads the q latent: q_lora_rank must be set")
        if self.indexer.head_dim < self.qk_rope_head_dim:
            raise ConfigError(f"index_head_dim ({self.indexer.head_dim}) must be at least qk_rope_head_dim "
                              f"({self.qk_rope_head_dim}): the indexer rotates qk_rope_head_dim of its dims")

    def cache_specs(self, config) -> tuple[PagedLatent, ...]:
        latent = PagedLatent(self.kv_lora_rank, self.qk_rope_head_dim)
        if self.indexer is None:
            return (latent,)
        return latent, PagedSide("index_keys", self.indexer.head_dim)

    def rotary(self, config) -> RotaryEmbedding | None:
        if not self.use_rope:
            return None
        return RotaryEmbedding(config.rope, self.qk_rope_head_dim, config.max_position_embeddings)

    def module(self, config, param_dtype) -> "MultiHeadLatentAttention":
        return MultiHeadLatentAttention(self, config.num_attention_heads, param_dtype, name=self.name)


class MultiHeadLatentAttention(nn.Module):
    spec: MLA
    num_heads: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: SublayerInput, cache: dict, md: StepMetadata, rotary, across_layers: dict | None = None):
        """``x``: the block's input (its pending norm folded into the first projections); ``cache``:
        {"latent"} (and "index_keys" with an indexer); ``rotary``: (cos, sin) over
        qk_rope_head_dim, or None (NoPE); ``across_layers`` (sparse attention): the forward's values
        handed between layers, where an indexer leaves its selection for a sharing layer after it.
        -> (output, the updated cache)."""
        s, t, hidden = self.spec, x.shape[0], x.shape[-1]
        heads = local.local(self.num_heads, HEADS)  # this device's
        qk_head = s.qk_nope_head_dim + s.qk_rope_head_dim
        q_width = self.num_heads * qk_head  # all heads (a declared size)
        # The two projections of the block's input, in one op (with the block's norm, when given).
        q_first = (LinearParams(s.q_lora_rank, s.attention_bias, self.param_dtype, name="q_a_proj") if s.q_lora_rank
                   else LinearParams(q_width, False, self.param_dtype, (HEADS, None), name="q_proj"))(hidden)
        kv_a = LinearParams(s.kv_lora_rank + s.qk_rope_head_dim, s.attention_bias, self.param_dtype,
                            name="kv_a_proj_with_mqa")(hidden)
        weights, biases = [q_first[0], kv_a[0]], [q_first[1], kv_a[1]]
        if s.output_gate:  # one gate per head, column-parallel like the heads
            gate_weight, _ = LinearParams(self.num_heads, False, self.param_dtype, (HEADS, None), name="g_proj")(hidden)
            weights.append(gate_weight)
            biases.append(None)
        if s.value_gate:  # one gate per value dim of each head, column-parallel like the heads
            gate_weight, _ = LinearParams(self.num_heads * s.v_head_dim, False, self.param_dtype, (HEADS, None),
                                          name="gate_proj")(hidden)
            weights.append(gate_weight)
            biases.append(None)
        if s.indexer is not None:  # the indexer projects the normed input too
            normed = x.normed()
            q, kv, *gate = linear_ops.project(normed, weights, biases)
        else:
            q, kv, *gate = x.project(weights, biases)
        if s.q_lora_rank:
            q = q_resid = RMSNorm(LATENT_NORM_EPS, param_dtype=self.param_dtype, name="q_a_layernorm")(q)
            q = Linear(q_width, False, self.param_dtype, (HEADS, None), name="q_b_proj")(q)
        q = q.reshape(t, heads, qk_head)
        q_nope, q_rope = q[..., :s.qk_nope_head_dim], q[..., s.qk_nope_head_dim:]
        latent = RMSNorm(LATENT_NORM_EPS, param_dtype=self.param_dtype, name="kv_a_layernorm")(kv[:, :s.kv_lora_rank])
        k_rope = kv[:, None, s.kv_lora_rank:]
        if rotary is not None:
            rotate = apply_rotary_interleaved if s.rope_interleave else apply_rotary
            q_rope, k_rope = rotate(q_rope, *rotary), rotate(k_rope, *rotary)
        latent_scale, index_scale = fp8.scales_of(cache, "latent", "index_keys")  # an fp8 cache's scales
        latent_scaled = {} if latent_scale is None else {"cache_scale": latent_scale}
        latent_cache = mla_ops.write_latent_cache(cache["latent"], latent, k_rope[:, 0], md.slot_mapping,
                                                  **latent_scaled)
        new_cache = {**cache, "latent": latent_cache}

        # kv_b's rows per head: [k_nope (W_UK) | v (W_UV)], each against the latent; this device's heads.
        kv_b, _ = LinearParams(self.num_heads * (s.qk_nope_head_dim + s.v_head_dim), False, self.param_dtype,
                               (HEADS, None), name="kv_b_proj")(s.kv_lora_rank)
        kv_b = as_array(kv_b, self.param_dtype).reshape(heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        w_uk, w_uv = kv_b[:, :s.qk_nope_head_dim], kv_b[:, s.qk_nope_head_dim:]
        q_latent = jnp.einsum("thn,hnr->thr", q_nope, w_uk)  # float32 sums, rounded once to the input dtype
        scale = s.softmax_scale or qk_head ** -0.5
        attend = dict(latent_scaled)
        if s.sinks:  # by head, like the heads
            attend["sinks"] = local.param(self, "sinks", nn.initializers.zeros, (self.num_heads,), (HEADS,),
                                          jnp.float32)
        if s.indexer is not None or s.shares_selection:
            if s.indexer is not None:
                slots, new_cache["index_keys"] = LightningIndexer(s.indexer, self.param_dtype, name="indexer")(
                    normed, q_resid, cache["index_keys"], md, rotary, index_scale)
                across_layers[SELECTION] = slots
            elif SELECTION not in across_layers:
                raise ConfigError("a layer that shares the sparse-attention selection needs an indexer layer before it")
            # Slots index every layer's cache alike: one page pool, one block table per sequence.
            out = sparse_ops.sparse_mla_attention(q_latent, q_rope, latent_cache, across_layers[SELECTION],
                                                  scale=scale, **attend)
        elif md.decode:
            out = mla_ops.mla_paged_decode_attention(q_latent, q_rope, latent_cache, md.block_tables, md.seq_lens,
                                                     scale=scale, **attend)
        else:
            out = mla_ops.mla_ragged_paged_attention(q_latent, q_rope, latent_cache, md.positions, md.token_seq_ids,
                                                     md.block_tables, md.seq_lens, scale=scale, valid=md.valid,
                                                     **attend)
        if capture.wanted(self, capture.ATTENTIONS):
            selected = across_layers[SELECTION] if s.across_layers else None
            capture.record(self, capture.ATTENTIONS, "probs", latent_attention_probs(
                q_latent, q_rope, latent_cache, md.positions, md.token_seq_ids, md.block_tables, scale=scale,
                selected_slots=selected))
        values = jnp.einsum("thr,hvr->thv", out, w_uv)
        if s.output_gate:
            values = values * jax.nn.sigmoid(gate[0].astype(jnp.float32)).astype(values.dtype)[..., None]
        if s.value_gate:
            values = values * jax.nn.sigmoid(gate[0].reshape(t, heads, s.v_head_dim).astype(values.dtype))
        out = Linear(hidden, s.attention_bias, self.param_dtype, (None, HEADS), name="o_proj")(
            values.reshape(t, heads * s.v_head_dim))
        return out, new_cache


class LightningIndexer(nn.Module):
    """-> (each token's selected cache slots [T, top_k], the updated indexer key cache)."""

    spec: Indexer
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, q_resid, cache, md: StepMetadata, rotary, cache_scale=None):
        """``x``: the block's normed input; ``q_resid``: the normed q latent (HF's name);
        ``cache_scale``: an fp8 key cache's scale."""
        s, t = self.spec, x.shape[0]
        q = Linear(s.num_heads * s.head_dim, False, self.param_dtype, name="wq_b")(q_resid)
        q = q.reshape(t, s.num_heads, s.head_dim)
        norm_dtype = jnp.float32 if s.key_norm_float32 else self.param_dtype
        k = LayerNorm(s.key_norm_eps, norm_dtype, name="k_norm")(
            Linear(s.head_dim, False, self.param_dtype, name="wk")(x))
        if rotary is not None:
            rotate = (_rotate_interleaved_prefix if s.rope_interleave else _rotate_suffix if s.rope_last
                      else apply_rotary)
            q, k = rotate(q, *rotary), rotate(k[:, None], *rotary)[:, 0]
        weights = Linear(s.num_heads, False, jnp.float32, name="weights_proj")(x.astype(jnp.float32))
        weights, scale = weights * s.num_heads ** -0.5, s.head_dim ** -0.5
        if s.scale_in_weights:
            weights, scale = weights * scale, 1.0
        scaled = {} if cache_scale is None else {"cache_scale": cache_scale}
        cache = sparse_ops.write_index_keys(cache, k, md.slot_mapping, **scaled)
        slots = sparse_ops.indexer_select(q, weights, cache, md.positions, md.token_seq_ids, md.block_tables,
                                          scale=scale, top_k=s.top_k, **scaled)
        if capture.wanted(self, capture.INDEXER):
            capture.record(self, capture.INDEXER, "selected_slots", slots)
        return slots, cache
