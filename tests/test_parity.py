"""Whole-model parity against HF transformers, every family's cases (tests/families.py) on tiny random
float32 checkpoints: a full forward's logits within 1e-4 of HF's and, but for the logits-only cases,
16 greedy tokens equal to HF ``generate``'s."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxinfer import load_model
from tests.conftest import assert_greedy_matches_hf, random_prompts
from tests.families import LOGITS_ONLY, PARITY_CASES

DENSE = {"llama", "mistral", "qwen2", "qwen3"}  # greedy over three prompts served together; the others two


@pytest.mark.parametrize("case", sorted(PARITY_CASES))
def test_full_forward_logits_match_hf(case, hf_checkpoint):
    family, overrides = PARITY_CASES[case]
    path, hf_model = hf_checkpoint(family, **overrides)
    ids = random_prompts([40], seed=1)[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    ours = load_model(path, dtype="float32").logits(ids)
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", sorted(PARITY_CASES.keys() - LOGITS_ONLY))
def test_greedy_tokens_match_hf_generate(case, hf_checkpoint):
    family, overrides = PARITY_CASES[case]
    path, hf_model = hf_checkpoint(family, **overrides)
    if family in DENSE:
        assert_greedy_matches_hf(path, hf_model, random_prompts([7, 21, 30], seed=2))
    else:
        assert_greedy_matches_hf(path, hf_model, random_prompts([9, 26], seed=2), max_num_seqs=2)
