"""Whole-model parity against HF transformers (PyTorch, float32, tiny random checkpoints)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxinfer import load_model
from tests.conftest import assert_greedy_matches_hf, random_prompts

CASES = {
    "llama-gqa": ("llama", {}),
    "llama-llama3-rope": ("llama", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "llama-yarn-rope": ("llama", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32))),
    "mistral-sliding-window": ("mistral", dict(sliding_window=8)),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=True)),
}

# Length-dependent and other scaling types: logits parity only (they share the engine path above).
LOGITS_ONLY = {
    "llama-linear-rope": ("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "llama-dynamic-rope": ("llama", dict(max_position_embeddings=16, rope_parameters=dict(
        rope_type="dynamic", rope_theta=10000.0, factor=2.0))),
    "llama-longrope": ("llama", dict(max_position_embeddings=64, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=16,
        long_factor=[1.0 + 0.25 * i for i in range(8)], short_factor=[1.0 + 0.05 * i for i in range(8)]))),
    "qwen2-sliding-layers": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
}


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("case", sorted({**CASES, **LOGITS_ONLY}))
def test_full_forward_logits_match_hf(case, hf_checkpoint):
    family, overrides = {**CASES, **LOGITS_ONLY}[case]
    path, hf_model = hf_checkpoint(family, **overrides)
    ids = random_prompts([40], seed=1)[0]
    ours = load_model(path, dtype="float32").logits(ids)
    ref = _hf_logits(hf_model, ids)
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_match_hf_generate(case, hf_checkpoint):
    family, overrides = CASES[case]
    path, hf_model = hf_checkpoint(family, **overrides)
    assert_greedy_matches_hf(path, hf_model, random_prompts([7, 21, 30], seed=2))
