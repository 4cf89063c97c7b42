"""Whole models through the Pallas kernels (interpret mode, CPU) against HF transformers.

On a GPU the op dispatchers pick the kernels; on CPU they pick the references, so the other model
tests never run the kernels. Here every kernel op is installed in interpret mode: logits (prefill
attention, the fused q/k norm + RoPE + cache write, residual add + RMSNorm, routing, the grouped
GEMMs) and greedy tokens (decode attention, the few-row q/k/v and gate/up projections) must still
match HF.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from jaxinfer import load_model
from jaxinfer.kernels import attention, linear, moe, norm
from jaxinfer.kernels.linear import reference as linear_reference
from jaxinfer.kernels.linear import skinny_pallas
from jaxinfer.kernels.moe import router_pallas
from tests.conftest import assert_greedy_matches_hf, random_prompts
from tests.test_moe import CASES as MOE_CASES
from tests.test_moe import MOE

CASES = {
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=True)),  # per-head q/k norm in the RoPE kernel
    "mistral-sliding-window": ("mistral", dict(sliding_window=8)),
    **{name: (family, dict(MOE, **overrides)) for name, (family, overrides) in MOE_CASES.items()},
}


def _few_row_projections(x, weights, biases=None):
    if x.size // x.shape[-1] <= skinny_pallas.MAX_ROWS:
        return skinny_pallas.project(x, weights, biases, interpret=True)
    return linear_reference.project(x, weights, biases)


@pytest.fixture
def interpreted_kernels(monkeypatch):
    for ops in (attention, linear, moe, norm):
        dispatch = ops._dispatch
        kernels = {op: functools.partial(fn, interpret=True) for op, fn in dispatch.implementations["pallas"].items()}
        # The kernels themselves, not their size policies: the models route through the routing
        # kernel at every size, and decode steps of up to 16 rows project through the few-row kernel.
        if ops is moe:
            kernels["route"] = functools.partial(router_pallas.route, interpret=True)
        if ops is linear:
            kernels["project"] = _few_row_projections
        monkeypatch.setitem(dispatch.implementations, "pallas", kernels)
        monkeypatch.setattr(dispatch, "forced", "pallas")


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernels_match_hf(case, hf_checkpoint, interpreted_kernels):
    family, overrides = CASES[case]
    path, hf_model = hf_checkpoint(family, **overrides)
    ids = random_prompts([40], seed=1)[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(load_model(path, dtype="float32").logits(ids), ref, atol=1e-4, rtol=0)
    assert_greedy_matches_hf(path, hf_model, random_prompts([9, 26], seed=2), max_num_seqs=2)
