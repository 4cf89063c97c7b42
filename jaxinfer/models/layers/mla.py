"""The MLA mixer: multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache.

q = q_b(RMSNorm(q_a(x))) (or q_proj(x) without a q LoRA), per head ``[nope | rope]``; kv_a(x) =
``[latent (kv_lora_rank) | k_rope (qk_rope_head_dim)]``, the latent RMS-normalised, k_rope one head
shared by all. The cache keeps only ``[latent | rotated k_rope]`` per token (``PagedLatent``).
Attention runs in absorbed form, for prefill chunks and decode alike: ``q_nope`` goes through W_UK
(kv_b's key rows) into the latent space, scores are ``q_latent . latent + q_rope . k_rope``, the
output is a sum of latents, and W_UV (kv_b's value rows) maps it to each head's values. One code path
then reads cached pages for chunked prefill and decode; the expanded form (keys and values per head
from kv_b, fewer FLOPs per key at long prompts) is left to a GPU prefill kernel.
The latent and q_a norms use eps 1e-6 whatever ``rms_norm_eps`` says, as HF does.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from jaxinfer.cache.metadata import AttentionMetadata
from jaxinfer.cache.specs import PagedLatent
from jaxinfer.kernels import linear as linear_ops
from jaxinfer.kernels import mla as mla_ops
from jaxinfer.kernels.math import apply_rotary, apply_rotary_interleaved
from jaxinfer.models.layers.linear import Linear, LinearParams
from jaxinfer.models.layers.norm import PreNorm, RMSNorm
from jaxinfer.models.layers.rope import RotaryEmbedding

LATENT_NORM_EPS = 1e-6  # HF's q_a_layernorm and kv_a_layernorm: hard-coded, not rms_norm_eps


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
    name: str = "self_attn"

    def validate(self, config) -> None:
        """Nothing beyond the sizes the family checks as it reads them (RoPE's width is checked with the
        other mixers' through ``rotary``)."""

    def cache_specs(self, config) -> tuple[PagedLatent, ...]:
        return (PagedLatent(self.kv_lora_rank, self.qk_rope_head_dim),)

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
    def __call__(self, x, cache: dict, md: AttentionMetadata, rotary, prenorm: PreNorm | None = None):
        """``cache``: {"latent"}; ``rotary``: (cos, sin) over qk_rope_head_dim, or None (NoPE).
        -> (output, the updated cache, the residual stream after ``prenorm``'s add; None without one)."""
        s, heads, t, hidden = self.spec, self.num_heads, x.shape[0], x.shape[-1]
        qk_head = s.qk_nope_head_dim + s.qk_rope_head_dim
        # The two projections of the block's input, in one op (with the block's norm, when given).
        q_first = (LinearParams(s.q_lora_rank, s.attention_bias, self.param_dtype, name="q_a_proj") if s.q_lora_rank
                   else LinearParams(heads * qk_head, False, self.param_dtype, name="q_proj"))(hidden)
        kv_a = LinearParams(s.kv_lora_rank + s.qk_rope_head_dim, s.attention_bias, self.param_dtype,
                            name="kv_a_proj_with_mqa")(hidden)
        weights, biases = [q_first[0], kv_a[0]], [q_first[1], kv_a[1]]
        if prenorm is None:
            (q, kv), residual = linear_ops.project(x, weights, biases), None
        else:
            (q, kv), residual = prenorm.project(x, weights, biases)
        if s.q_lora_rank:
            q = RMSNorm(LATENT_NORM_EPS, param_dtype=self.param_dtype, name="q_a_layernorm")(q)
            q = Linear(heads * qk_head, False, self.param_dtype, name="q_b_proj")(q)
        q = q.reshape(t, heads, qk_head)
        q_nope, q_rope = q[..., :s.qk_nope_head_dim], q[..., s.qk_nope_head_dim:]
        latent = RMSNorm(LATENT_NORM_EPS, param_dtype=self.param_dtype, name="kv_a_layernorm")(kv[:, :s.kv_lora_rank])
        k_rope = kv[:, None, s.kv_lora_rank:]
        if rotary is not None:
            rotate = apply_rotary_interleaved if s.rope_interleave else apply_rotary
            q_rope, k_rope = rotate(q_rope, *rotary), rotate(k_rope, *rotary)
        latent_cache = mla_ops.write_latent_cache(cache["latent"], latent, k_rope[:, 0], md.slot_mapping)

        # kv_b's rows per head: [k_nope (W_UK) | v (W_UV)], each against the latent.
        kv_b, _ = LinearParams(heads * (s.qk_nope_head_dim + s.v_head_dim), False, self.param_dtype,
                               name="kv_b_proj")(s.kv_lora_rank)
        kv_b = kv_b.reshape(heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        w_uk, w_uv = kv_b[:, :s.qk_nope_head_dim], kv_b[:, s.qk_nope_head_dim:]
        q_latent = jnp.einsum("thn,hnr->thr", q_nope, w_uk, preferred_element_type=jnp.float32).astype(q.dtype)
        scale = s.softmax_scale or qk_head ** -0.5
        if md.decode:
            out = mla_ops.mla_paged_decode_attention(q_latent, q_rope, latent_cache, md.block_tables, md.seq_lens,
                                                     scale=scale)
        else:
            out = mla_ops.mla_ragged_paged_attention(q_latent, q_rope, latent_cache, md.positions, md.token_seq_ids,
                                                     md.block_tables, md.seq_lens, scale=scale, valid=md.valid)
        values = jnp.einsum("thr,hvr->thv", out, w_uv, preferred_element_type=jnp.float32).astype(q.dtype)
        out = Linear(hidden, s.attention_bias, self.param_dtype, name="o_proj")(values.reshape(t, heads * s.v_head_dim))
        return out, {"latent": latent_cache}, residual
