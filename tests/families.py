"""The parity cases of every family; the sharding tests build their checkpoints from the same families."""

from __future__ import annotations

# Gemma 3 (text): the sandwich residual, (1 + w) norms, per-layer-type RoPE (local default, global
# linear), sliding layers with a window shorter than the prompt, ``query_pre_attn_scalar``, embeddings
# scaled by sqrt(hidden), the final logit soft-cap.
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}
GEMMA3 = {
    "sliding-and-global": dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                               query_pre_attn_scalar=24, rope_parameters=GEMMA3_ROPE),
    "soft-capped": dict(head_dim=16, sliding_window=64, final_logit_softcapping=3.0),
}

# Mixture-of-experts: each case's overrides on top of MOE.
MOE = dict(head_dim=16, intermediate_size=48)
MOE_CASES = {
    # Sparse layer 0, dense layer 1 (mlp_only_layers); renormalised and raw top-k weights.
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen3_moe-unnormalised": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                                 norm_topk_prob=False)),
    # Partial RoPE from the legacy rotary_dim, whole-vector q/k norm, sigmoid + correction-bias routing.
    "minimax_m2": ("minimax_m2", dict(num_local_experts=8, num_experts_per_tok=2, rotary_dim=8, bos_token_id=1,
                                      eos_token_id=2)),
    # Sinks, sliding window (8) shorter than the prompt on even layers, YaRN, biased experts.
    "gpt_oss": ("gpt_oss", dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=8)),
}

# Multi-head latent attention (DeepSeek-V3, Sarvam-MLA): each case's overrides on top of MLA. With and
# without a q LoRA, YaRN with mscale, interleaved and plain RoPE, grouped routing, a dense first
# layer, shared experts.
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
           moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
           routed_scaling_factor=2.5, first_k_dense_replace=1)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, mscale=1.0,
            mscale_all_dim=0.8, beta_fast=32, beta_slow=1)
MLA_CASES = {
    "q-lora-yarn-interleaved-groups": ("deepseek_v3", dict(q_lora_rank=32, rope_parameters=YARN, n_group=2,
                                                           topk_group=1)),
    "no-q-lora-plain-rope": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1,
                                                 n_shared_experts=2)),
    "sarvam-mla": ("sarvam_mla", dict(q_lora_rank=None, n_group=1, topk_group=1)),
}

# DeepSeek sparse attention. 16 indexer heads (with few, ReLU zeroes many scores and ties decide);
# index_topk below the prompts.
V32 = dict(num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
           moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
           routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=32, n_group=2, topk_group=1,
           index_n_heads=16, index_head_dim=16, index_topk=8)
# GLM-5: interleaved indexer RoPE; "shared" layers reuse the last full layer's selection.
GLM5 = dict({k: v for k, v in V32.items() if k not in ("n_group", "topk_group")}, num_hidden_layers=4,
            indexer_types=["full", "shared", "full", "shared"])

# HY-V4: a dense layer with its indexer, an MoE layer sharing that selection, an MoE layer with its own
# indexer (index_topk below the prompts); half-split RoPE, the indexer's RoPE on its last dims, per-head
# sinks, the per-value-dim output gate, a SwiGLU clamp (0.3) that clips the routed experts, 2 iHC streams.
HY_V4 = dict(num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
             v_head_dim=12, q_lora_rank=32, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
             n_shared_experts=1, routed_scaling_factor=2.5, index_n_heads=16, index_head_dim=16, index_topk=8,
             indexer_types=["full", "shared", "full"], mlp_layer_types=["dense", "sparse", "sparse"], hc_mult=2,
             swiglu_limit=0.3, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# The gated-DeltaNet hybrids: a DeltaNet layer and a gated full-attention layer; 2 key heads feeding
# 4 value heads; partial RoPE.
HYBRID = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], head_dim=16,
              linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_conv_kernel_dim=4, initializer_range=0.1,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
HYBRID_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
GATED_DELTANET = {
    "qwen3_next": dict(HYBRID, **HYBRID_MOE, decoder_sparse_step=2),  # a dense and a sparse layer
    "qwen3_5": HYBRID,
    "qwen3_5_moe": dict(HYBRID, **HYBRID_MOE),
}

# MiniMax-Text-01: lightning / full / lightning (the last layer's decay is about 0); the residual
# factors all differ, so a swap shows. HF's MiniMax RoPE ignores the partial factor: the parity fails
# if only half of each head is rotated. HF's prefill runs block by block: a 40-token prompt spans three.
MINIMAX = dict(num_hidden_layers=3, head_dim=16,
               layer_types=["linear_attention", "full_attention", "linear_attention"],
               num_local_experts=6, num_experts_per_tok=2, block_size=16, initializer_range=0.1,
               linear_attn_alpha_factor=1.5, linear_attn_beta_factor=0.7, full_attn_alpha_factor=1.2,
               full_attn_beta_factor=0.9, mlp_alpha_factor=1.3, mlp_beta_factor=0.6,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})

# Kimi-Linear: KDA, MLA, KDA (given as the hub gives them: 1-indexed layer lists) with a dense first
# layer; 2 KDA heads of 16; MLA over a 16-wide latent with 4 heads of 16 + 8 (NoPE) dims; 4 experts, 2
# per token.
KIMI_LINEAR = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=4, num_experts_per_token=2,
                   moe_intermediate_size=32, num_shared_experts=1, first_k_dense_replace=1, initializer_range=0.1,
                   linear_attn_config=dict(kda_layers=[1, 3], full_attn_layers=[2], num_heads=2, head_dim=16,
                                           short_conv_kernel_size=4),
                   pad_token_id=0, bos_token_id=1, eos_token_id=2)

# Bailing-MoE-V3: KDA (4 heads of 16: full-rank forget and output gates, the safe gate at a bound of -3),
# KDA, then MLA (layer_group_size 3) with interleaved RoPE and its per-head output gate; a dense first
# layer, then grouped DeepSeek routing (2 groups of 4, 1 kept) with a shared expert.
BAILING_HYBRID = dict(num_hidden_layers=3, layer_group_size=3, num_key_value_heads=4, head_dim=16, kv_lora_rank=16,
                      qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, num_local_experts=8,
                      num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32, n_shared_experts=1,
                      first_k_dense_replace=1, kda_lower_bound=-3.0, initializer_range=0.1, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)

# Muse Glimmer, saved as the multimodal checkpoint (a one-layer vision tower, skipped): sliding,
# sliding, full NoPE layers (HF's rule: every 4th counted back from the last), a window of 8 below the
# prompt, biased q/k/v/o, the sigmoid output gate, post-sublayer norms at an eps large enough to show,
# a logit multiplier and a soft-cap that bends the logits, placeholder ids in the prompts
# (``muse_glimmer_config``). Then the two layer lists crossed (a sliding NoPE layer, a full RoPE
# layer) with a text config asking for tied embeddings, which HF's wrapper does not tie.
MUSE_GLIMMER = dict(num_hidden_layers=3, head_dim=16, sliding_window=8, attention_bias=True, initializer_range=0.1,
                    qk_scale_factor=2.5, post_norm_eps=0.05, output_multiplier=3.0, final_logit_softcapping=2.0,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2)
MUSE_GLIMMER_CROSSED = dict(MUSE_GLIMMER, num_hidden_layers=2, tie_word_embeddings=True,
                            layer_types=["sliding_attention", "full_attention"], layer_rope_theta=[0, 10000.0])


def muse_glimmer_config(**text):
    """HF's config of a Muse Glimmer checkpoint: the text config ``text``, a tiny vision tower, and image
    and video placeholder ids (embedded as token 0 by HF's text path) that the parity prompts hold."""
    import transformers

    vision = dict(hidden_size=16, num_attention_heads=2, num_hidden_layers=1, intermediate_size=16, patch_size=2,
                  pos_emb_height=2, pos_emb_width=2)
    return transformers.MuseGlimmerConfig(text_config=text, vision_config=vision, out_hidden_size=64,
                                          projector_hidden_size=16, image_token_id=75, video_token_id=66)


# Case name -> (family of ``make_hf_checkpoint``, HF config overrides).
PARITY_CASES: dict[str, tuple[str, dict]] = {
    "llama-gqa": ("llama", {}),
    "llama-llama3-rope": ("llama", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "llama-yarn-rope": ("llama", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32))),
    "llama-linear-rope": ("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "llama-dynamic-rope": ("llama", dict(max_position_embeddings=16, rope_parameters=dict(
        rope_type="dynamic", rope_theta=10000.0, factor=2.0))),
    "llama-longrope": ("llama", dict(max_position_embeddings=64, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=16,
        long_factor=[1.0 + 0.25 * i for i in range(8)], short_factor=[1.0 + 0.05 * i for i in range(8)]))),
    "mistral-sliding-window": ("mistral", dict(sliding_window=8)),
    "qwen2": ("qwen2", {}),
    "qwen2-sliding-layers": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=True)),
    **{f"gemma3-{name}": ("gemma3", overrides) for name, overrides in GEMMA3.items()},
    **{name: (family, dict(MOE, **overrides)) for name, (family, overrides) in MOE_CASES.items()},
    **{f"deepseek_v3-{name}": ("deepseek_v3", dict(MLA, **MLA_CASES[name][1]))
       for name in ("q-lora-yarn-interleaved-groups", "no-q-lora-plain-rope")},
    "sarvam_mla": ("sarvam_mla", dict(MLA, **MLA_CASES["sarvam-mla"][1])),
    "deepseek_v32": ("deepseek_v32", V32),
    "deepseek_v32-yarn-mlp-layer-types": ("deepseek_v32", dict(V32, rope_parameters=YARN, num_hidden_layers=3,
                                                               mlp_layer_types=["dense", "sparse", "dense"])),
    "glm_moe_dsa-shared-layers": ("glm_moe_dsa", GLM5),
    "hy_v4": ("hy_v4", HY_V4),
    **{family: (family, overrides) for family, overrides in GATED_DELTANET.items()},
    "minimax": ("minimax", MINIMAX),
    "minimax-sliding": ("minimax", dict(MINIMAX, sliding_window=8)),
    "kimi_linear": ("kimi_linear", KIMI_LINEAR),
    "muse_glimmer": ("muse_glimmer", MUSE_GLIMMER),
    "muse_glimmer-crossed-layers-untied": ("muse_glimmer", MUSE_GLIMMER_CROSSED),
    "bailing_hybrid": ("bailing_hybrid", BAILING_HYBRID),
}

# Checked on their logits alone: the length-dependent and other RoPE scalings and Qwen2's sliding
# layers (their engine path is the other dense cases'), and the state-slot hybrids, whose own files
# check greedy tokens against HF's under strict mode with slots handed on (MiniMax's without a window).
LOGITS_ONLY = frozenset({"llama-linear-rope", "llama-dynamic-rope", "llama-longrope", "qwen2-sliding-layers",
                         "qwen3_next", "minimax", "minimax-sliding", "kimi_linear",
                         "muse_glimmer-crossed-layers-untied"})

FAMILIES = sorted({family for family, _ in PARITY_CASES.values()})
