"""Gemma 3 (text) against transformers: the sandwich residual, (1 + w) norms, per-layer-type RoPE
(local default, global linear), sliding layers with a window shorter than the prompt,
``query_pre_attn_scalar``, embeddings scaled by sqrt(hidden), the final logit soft-cap."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxinfer import load_model
from tests.conftest import assert_greedy_matches_hf, random_prompts

ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}
CASES = {
    "sliding-and-global": dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                               query_pre_attn_scalar=24, rope_parameters=ROPE),
    "soft-capped": dict(head_dim=16, sliding_window=64, final_logit_softcapping=3.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_tokens_match_hf(case, hf_checkpoint):
    path, hf_model = hf_checkpoint("gemma3", **CASES[case])
    ids = random_prompts([40], seed=1)[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(load_model(path, dtype="float32").logits(ids), ref, atol=1e-4, rtol=0)
    assert_greedy_matches_hf(path, hf_model, random_prompts([9, 26], seed=2), max_num_seqs=2)
