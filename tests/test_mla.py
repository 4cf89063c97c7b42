"""Multi-head latent attention families against transformers: DeepSeek-V3 (with and without a q
LoRA, YaRN with mscale, interleaved and plain RoPE, grouped routing, dense first layers, shared
experts), a Sarvam-MLA config, and a Kimi-K2.5-style multimodal checkpoint (its text model); and
the engine over the latent cache (batching, chunked prefill, preemption)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxinfer import load_model
from tests.conftest import (assert_greedy_matches_hf, assert_logits_and_greedy_match_hf,
                            assert_serving_is_consistent, random_prompts)

MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
           moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
           routed_scaling_factor=2.5, first_k_dense_replace=1)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, mscale=1.0,
            mscale_all_dim=0.8, beta_fast=32, beta_slow=1)
CASES = {
    "q-lora-yarn-interleaved-groups": ("deepseek_v3", dict(q_lora_rank=32, rope_parameters=YARN, n_group=2,
                                                           topk_group=1)),
    "no-q-lora-plain-rope": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1,
                                                 n_shared_experts=2)),
    "sarvam-mla": ("sarvam_mla", dict(q_lora_rank=None, n_group=1, topk_group=1)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_tokens_match_hf(case, hf_checkpoint):
    family, overrides = CASES[case]
    assert_logits_and_greedy_match_hf(*hf_checkpoint(family, **{**MLA, **overrides}))


def test_mscale_changes_the_softmax_scale():
    from jaxinfer.config import ModelConfig
    from jaxinfer.models.deepseek_v3 import yarn_softmax_scale

    config = ModelConfig.from_dict(dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                                        rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=40.0,
                                                             original_max_position_embeddings=4096, mscale=1.0,
                                                             mscale_all_dim=1.0)))
    mscale = 0.1 * np.log(40.0) + 1.0
    assert yarn_softmax_scale(config, 192) == pytest.approx(192 ** -0.5 * mscale ** 2)  # about x1.874


@pytest.fixture(scope="module")
def kimi_k25(tmp_path_factory):
    """A tiny Kimi-K2.5-style checkpoint: a DeepSeek-V3 text model under ``language_model.*`` with a
    vision tower and projector beside it, saved by transformers."""
    import transformers
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config

    from tests.conftest import TINY

    text = dict(model_type="deepseek_v3", **{**TINY, **MLA, "q_lora_rank": 32, "n_group": 1, "topk_group": 1})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=2,
                  pos_emb_height=4, pos_emb_width=4, pos_emb_time=1)
    config = Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=32,
                            tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Kimi_K25ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
            if ".experts." in name and p.dim() >= 2:
                p.normal_(0.0, 0.05)
    path = tmp_path_factory.mktemp("kimi-k25")
    model.save_pretrained(path)
    return str(path), model


def test_kimi_k25_serves_its_text_model(kimi_k25, caplog):
    path, hf_model = kimi_k25
    ids = random_prompts([30], seed=3)[0]
    with torch.no_grad():
        ref = hf_model(input_ids=torch.tensor([ids])).logits[0].numpy()
    with caplog.at_level("WARNING"):
        model = load_model(path, dtype="float32")
    assert sum("vision tower" in r.message for r in caplog.records) == 1
    np.testing.assert_allclose(model.logits(ids), ref, atol=1e-4, rtol=0)
    assert_greedy_matches_hf(path, hf_model, random_prompts([9], seed=4), max_num_seqs=1)


def test_multi_token_prediction_layers_are_skipped(hf_checkpoint, tmp_path, caplog):
    import shutil

    from safetensors.numpy import load_file, save_file

    family, overrides = CASES["no-q-lora-plain-rope"]
    source, _ = hf_checkpoint(family, **{**MLA, **overrides})
    path = shutil.copytree(source, tmp_path / "with-mtp")
    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if n.startswith("model.layers.1.")]:
        tensors[name.replace("model.layers.1.", "model.layers.2.")] = tensors[name]
    save_file(tensors, str(path / "model.safetensors"))
    ids = [5, 9, 13]
    with caplog.at_level("WARNING"):
        logits = load_model(path).logits(ids)
    assert any("multi-token-prediction" in r.message for r in caplog.records)
    np.testing.assert_array_equal(logits, load_model(source).logits(ids))


@pytest.fixture(scope="module")
def mla_engine(hf_checkpoint):
    family, overrides = CASES["q-lora-yarn-interleaved-groups"]
    path, _ = hf_checkpoint(family, **{**MLA, **overrides})
    return path


def test_batched_chunked_and_preempted_equal_one_at_a_time(mla_engine):
    assert_serving_is_consistent(mla_engine)


def test_bfloat16_runs_where_dots_refuse_bfloat16_into_float32(mla_engine):
    """XLA's CPU dots refuse bf16 operands with a float32 result; the absorbed projections round their
    float32 sums to bf16 inside the dot instead, so a bf16 checkpoint runs there and stays near float32."""
    ids = list(range(3, 60))
    full, half = load_model(mla_engine).logits(ids), load_model(mla_engine, "bfloat16").logits(ids)
    assert half.dtype == np.float32 and np.isfinite(half).all()
    assert np.abs(half - full).max() <= 0.02 * np.abs(full).max()
