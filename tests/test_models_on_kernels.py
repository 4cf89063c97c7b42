"""Whole models through the Pallas kernels (interpret mode, CPU) against HF transformers.

On a GPU the registry picks the kernels; on CPU it picks the references, so the other model tests
never run the kernels. Here the target is the kernels in interpret mode: logits (prefill
attention, the fused q/k norm + RoPE + cache write, residual add + RMSNorm, routing, the grouped
GEMMs) and greedy tokens (decode attention, the few-row q/k/v and gate/up projections) must still
match HF.
"""

from __future__ import annotations

import pytest

from jaxinfer.kernels import registry
from jaxinfer.kernels.linear import reference as linear_reference
from jaxinfer.kernels.linear import skinny_pallas
from tests.conftest import assert_logits_and_greedy_match_hf
from tests.families import MOE, MOE_CASES

CASES = {
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=True)),  # per-head q/k norm in the RoPE kernel
    "mistral-sliding-window": ("mistral", dict(sliding_window=8)),
    # The MoE families; raw top-k weights are the routing kernel's own test's (test_router_kernel).
    **{name: (family, dict(MOE, **overrides)) for name, (family, overrides) in MOE_CASES.items()
       if name != "qwen3_moe-unnormalised"},
}


def _few_row_projections(x, weights, biases=None, *, interpret: bool):
    if x.size // x.shape[-1] <= skinny_pallas.MAX_ROWS:
        return skinny_pallas.project(x, weights, biases, interpret=interpret)
    return linear_reference.project(x, weights, biases)


@pytest.fixture
def interpreted_kernels():
    """The kernels in interpret mode, and what served each op. The kernels themselves, not their
    size policies: the models route through the routing kernel at every size, and decode steps of up
    to 16 rows project through the few-row kernel."""
    with registry.targeting(registry.Target.interpreted()), registry.force("moe.route", "router"), \
            registry.variant("linear.project", _few_row_projections), registry.recording() as chosen:
        yield chosen


# The ops every model here runs through a kernel (never the reference) in interpret mode.
KERNEL_OPS = {"attention.rotary_cache_write": {"rotary"}, "attention.ragged_paged_attention": {"triton"},
              "attention.rotary_paged_decode_attention": {"triton"}, "norm.add_rms_norm": {"pallas"}}
MOE_KERNEL_OPS = {"moe.route": {"router"}, "moe.moe_mlp": {"grouped"}}
MOE_FAMILIES = {family for family, _ in MOE_CASES.values()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernels_match_hf(case, hf_checkpoint, interpreted_kernels):
    family, overrides = CASES[case]
    assert_logits_and_greedy_match_hf(*hf_checkpoint(family, **overrides))
    expected = dict(KERNEL_OPS, **(MOE_KERNEL_OPS if family in MOE_FAMILIES else {}))
    assert {op: interpreted_kernels.get(op) for op in expected} == expected
    assert interpreted_kernels["linear.project"] == {"variant"}
