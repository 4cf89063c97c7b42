"""The one-token MoE kernels (interpret mode, CPU) against the plain-jnp reference and the grouped kernel.

The same comparison at the real shapes (and the timings) on the GPU is in scripts/moe_check.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.kernels.moe import grouped_pallas, one_token_pallas, reference
from tests.test_moe_kernel import ALL_BIASES, make_case

B = one_token_pallas.Blocking
CASES = {
    # name: (k, E, H, I, dtype, activation, biases, distribution, kernel options)
    # Defaults: reduction steps longer than H (80) and I (48), so every load is masked.
    "silu-f32": (2, 8, 80, 48, jnp.float32, "silu", (), "uniform", {}),
    "gptoss-bias-f32": (4, 8, 80, 48, jnp.float32, "gpt_oss", ALL_BIASES, "uniform", {}),
    "gptoss-bias-bf16": (3, 8, 80, 48, jnp.bfloat16, "gpt_oss", ALL_BIASES, "uniform", {}),
    # Blocks that divide H and I: the unmasked loads, several reduction steps per row block.
    "silu-dividing-blocks-bf16": (4, 8, 64, 32, jnp.bfloat16, "silu", (), "uniform",
                                  dict(gate_up_blocking=B(8, 16, 4, 2), down_blocking=B(4, 16))),
    # Column blocks that do not divide I (48 / 32) or H (80 / 32): a partial last block.
    "partial-column-blocks-f32": (2, 8, 80, 48, jnp.float32, "gpt_oss", ("up_bias",), "uniform",
                                  dict(gate_up_blocking=B(32, 32), down_blocking=B(32, 32))),
    # Each slot written apart and summed in XLA.
    "slots-apart-bias-bf16": (3, 8, 80, 48, jnp.bfloat16, "silu", ("down_bias",), "uniform", dict(sum_slots=False)),
    # One expert picked twice by the token.
    "duplicates-f32": (3, 4, 80, 48, jnp.float32, "silu", ALL_BIASES, "duplicates", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_and_grouped_kernel(case):
    k, e, h, i, dtype, activation, biases, dist, options = CASES[case]
    x, ids, weights, params = make_case(1, k, e, h, i, dtype, biases=biases, dist=dist, seed=3)
    if dist == "duplicates":
        assert len(set(np.asarray(ids)[0].tolist())) < k  # the case really repeats an expert
    out = one_token_pallas.moe_mlp(x, ids, weights, **params, activation=activation, interpret=True, **options)
    assert out.shape == (1, h) and out.dtype == x.dtype
    ref = np.asarray(reference.moe_mlp(x, ids, weights, **params, activation=activation), np.float32)
    grouped = np.asarray(grouped_pallas.moe_mlp(x, ids, weights, **params, activation=activation, interpret=True),
                         np.float32)
    out = np.asarray(out, np.float32)
    scale = np.abs(ref).max()
    assert scale > 0.1  # a non-trivial output
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * scale)
    # The grouped kernel rounds exactly where this one does: only the float32 sums' order differs.
    np.testing.assert_allclose(out, grouped, rtol=tol, atol=1e-6 if dtype == jnp.float32 else 1e-2 * scale)


def test_default_blocking_at_real_shapes():
    for hidden, inter in ((2048, 768), (2880, 2880), (3072, 1536)):  # Qwen3-30B-A3B, GPT-OSS-20B, MiniMax-M2
        gate_up, down = one_token_pallas.default_blocking(hidden, inter)
        assert gate_up.block_k >= min(1024, hidden) and down.block_k >= min(1024, inter)
        assert gate_up.block_n == down.block_n == 4  # hundreds of programs per projection at one token


def test_rejects_what_it_does_not_take():
    x, ids, weights, params = make_case(2, 2, 4, 80, 48, jnp.float32)
    with pytest.raises(ValueError, match=r"\[1, H\]"):
        one_token_pallas.moe_mlp(x, ids, weights, **params, interpret=True)
    x, ids, weights, params = make_case(1, 2, 4, 80, 48, jnp.float32)
    with pytest.raises(ValueError, match="block_k"):
        one_token_pallas.moe_mlp(x, ids, weights, **params, interpret=True, down_blocking=B(4, 24))
    with pytest.raises(ValueError, match="block_n"):
        one_token_pallas.moe_mlp(x, ids, weights, **params, interpret=True, gate_up_blocking=B(0, 16))
    with pytest.raises(ValueError, match="expert weights"):
        one_token_pallas.moe_mlp(x, ids, weights, params["gate"], params["up"], params["gate"], interpret=True)
    with pytest.raises(ValueError, match="activation"):
        one_token_pallas.moe_mlp(x, ids, weights, **params, activation="gelu", interpret=True)
