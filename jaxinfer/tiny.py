"""Tiny random checkpoints in HuggingFace format, written without torch or a hub.

``write_tiny_checkpoint(path, family)`` writes ``config.json``, ``generation_config.json``,
``model.safetensors`` (random weights, HF tensor names) and a byte-level tokenizer with a chat
template. The default CLI run uses one; so can tests and notebooks. Its text output is random.
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np
from flax import traverse_util

from jaxinfer.config import ModelConfig
from jaxinfer.errors import ConfigError
from jaxinfer.registry import ModelRegistry

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>")  # ids 0, 1, 2; bytes follow
VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)

_COMMON = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, hidden_act="silu",
    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, dtype="float32",
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)

# Three gated DeltaNet layers and one gated full-attention layer (Qwen3-Next, Qwen3.5).
_GATED_DELTANET = dict(
    num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)

TINY_FAMILIES: dict[str, dict] = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, mlp_bias=False),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=32),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False,
                  sliding_window=None, max_window_layers=2),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False,
                  use_sliding_window=False, sliding_window=None, max_window_layers=2, tie_word_embeddings=True),
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[], use_sliding_window=False, sliding_window=None),
    "minimax_m2": dict(architectures=["MiniMaxM2ForCausalLM"], model_type="minimax_m2", num_local_experts=8,
                       num_experts_per_tok=2, rotary_dim=8),
    "gpt_oss": dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", num_local_experts=8,
                    num_experts_per_tok=2, sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
    "deepseek_v3": dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_key_value_heads=4,
                        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                        n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, head_dim=None),
    "deepseek_v32": dict(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", num_key_value_heads=4,
                         q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                         n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                         n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                         index_n_heads=16, index_head_dim=16, index_topk=8, head_dim=None),
    "glm_moe_dsa": dict(architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", num_key_value_heads=4,
                        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                        first_k_dense_replace=1, routed_scaling_factor=2.5, index_n_heads=16, index_head_dim=16,
                        index_topk=8, indexer_types=["full", "shared"], head_dim=None),
    # HY-V4: a dense layer with the indexer, then MoE layers (one sharing its selection); 2 hyper-connection
    # streams, half-split RoPE, sinks and the per-value-dim gate.
    "hy_v4": dict(architectures=["HYV4ForCausalLM"], model_type="hy_v4", num_hidden_layers=3, num_key_value_heads=4,
                  q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                  n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                  routed_scaling_factor=2.5, index_n_heads=16, index_head_dim=16, index_topk=8,
                  indexer_types=["full", "shared", "full"], mlp_layer_types=["dense", "sparse", "sparse"],
                  hc_mult=2, swiglu_limit=10.0, head_dim=None),
    "qwen3_next": dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", **_GATED_DELTANET,
                       num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_5": dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", **_GATED_DELTANET),
    "qwen3_5_moe": dict(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", **_GATED_DELTANET,
                        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32),
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", sliding_window=16, head_dim=16,
                   layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
                   tie_word_embeddings=True, rope_parameters=None),
    # The text config alone, as the served text model reads it: sliding, sliding, full NoPE (HF's defaults).
    "muse_glimmer": dict(architectures=["MuseGlimmerForConditionalGeneration"], model_type="muse_glimmer_text",
                         num_hidden_layers=3, sliding_window=16),
    # Lightning attention then softmax attention; HF's block-wise prefill in blocks of 16.
    "minimax": dict(architectures=["MiniMaxForCausalLM"], model_type="minimax", num_local_experts=8,
                    num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"], block_size=16),
    # Three KDA layers then a NoPE MLA layer (1-indexed, as hub configs list them); the first layer dense.
    "kimi_linear": dict(architectures=["KimiLinearForCausalLM"], model_type="kimi_linear", num_key_value_heads=4,
                        head_dim=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        num_experts=8, num_experts_per_token=2, moe_intermediate_size=32, num_shared_experts=1,
                        first_k_dense_replace=1, routed_scaling_factor=2.446,
                        linear_attn_config=dict(kda_layers=[1, 2, 3], full_attn_layers=[4], num_heads=2, head_dim=16,
                                                short_conv_kernel_size=4), num_hidden_layers=4),
    # Bailing-MoE-V3: three KDA layers (4 heads of 16, safe gate) then an MLA layer (layer_group_size 4) with
    # interleaved RoPE over 16 dims and its output gate; the first layer dense, grouped routing.
    "bailing_hybrid": dict(architectures=["BailingHybridForCausalLM"], model_type="bailing_hybrid",
                           num_key_value_heads=4, num_hidden_layers=4, layer_group_size=4, kv_lora_rank=16,
                           qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, num_experts=8,
                           num_experts_per_token=2, num_expert_group=2, topk_group=1, moe_intermediate_size=32,
                           num_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                           short_conv_kernel_size=4, kda_safe_gate=True, kda_lower_bound=-5.0),
}


def tiny_config(family: str = "llama", **overrides) -> dict:
    if family not in TINY_FAMILIES:
        raise ConfigError(f"unknown tiny family {family!r}; choose from {', '.join(TINY_FAMILIES)}")
    merged = {**_COMMON, **TINY_FAMILIES[family], **overrides}
    # None leaves a field to the config class's default (written as null, some classes would take it as set).
    return copy.deepcopy({key: value for key, value in merged.items() if value is not None})


def _write_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(byte_chars):
        vocab[ch] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=SPECIAL_TOKENS[0],
                                   bos_token=SPECIAL_TOKENS[1], eos_token=SPECIAL_TOKENS[2])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def write_tiny_checkpoint(path: str | os.PathLike, family: str = "llama", *, seed: int = 0,
                          with_tokenizer: bool = True, **config_overrides) -> str:
    from safetensors.numpy import save_file

    from jaxinfer.weights import init_params

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    raw = tiny_config(family, **config_overrides)
    config = ModelConfig.from_dict(raw)
    model_cls = ModelRegistry.resolve(config.architecture)
    params = traverse_util.flatten_dict(init_params(model_cls, config, seed))
    tensors = model_cls.checkpoint_tensors(config, {k: np.asarray(v, np.float32) for k, v in params.items()})
    # safetensors writes an array's memory as it lies: re-laid-out (transposed) tensors must be made contiguous.
    tensors = {name: np.ascontiguousarray(value) for name, value in tensors.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"]}, f, indent=2)
    if with_tokenizer:
        _write_tokenizer(path)
    return path


def jaxinfer_home() -> str:
    """Where the CLI keeps its files: ``$JAXINFER_HOME`` or ~/.cache/jaxinfer."""
    return os.environ.get("JAXINFER_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "jaxinfer")


def default_checkpoint_dir() -> str:
    """The CLI's built-in tiny checkpoint."""
    return os.path.join(jaxinfer_home(), "tiny-llama")


def ensure_default_checkpoint() -> str:
    path = default_checkpoint_dir()
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        write_tiny_checkpoint(path, "llama")
    return path
