"""The few-row projection kernel and its norm-folding form (interpret mode, CPU) against their
references, and the ops' checks."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.kernels import linear as linear_ops
from jaxinfer.kernels import registry
from jaxinfer.kernels.linear import reference, skinny_pallas


def _case(rows, out_features, in_features, dtype, bias_dtypes, seed=0):
    rng = np.random.RandomState(seed)
    x = jnp.asarray(rng.randn(rows, in_features), dtype)
    weights = [jnp.asarray(rng.randn(n, in_features) * in_features**-0.5, dtype) for n in out_features]
    biases = [None if b is None else jnp.asarray(rng.randn(n), b) for n, b in zip(out_features, bias_dtypes)]
    return x, weights, biases


@pytest.mark.parametrize("rows", [1, 3])  # elementwise path; tensor-core path with rows padded to 16
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("blocking", [None, skinny_pallas.Blocking(16, 32, 4, 2)])  # 200 columns: masked K blocks
def test_matches_reference(rows, dtype, blocking):
    # Three projections of ragged widths (48, 20, 7 columns: partial column blocks), biases on two, one
    # of them float32 (rounded to x's dtype, as the reference adds it).
    x, weights, biases = _case(rows, (48, 20, 7), 200, dtype, (None, dtype, jnp.float32))
    want = reference.project(x, weights, biases)
    got = skinny_pallas.project(x, weights, biases, blocking=blocking, interpret=True)
    assert len(got) == 3
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype == dtype
        # float32: rounding of the sums; bf16: the two sums may round one unit apart.
        tol = 1e-5 if dtype == jnp.float32 else 2**-7
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol)


def test_leading_axes_and_the_op():
    x, weights, biases = _case(6, (32, 16), 64, jnp.float32, (jnp.float32, None))
    x = x.reshape(2, 3, 64)
    got = skinny_pallas.project(x, weights, biases, interpret=True)
    want = linear_ops.project(x, weights, biases)  # on CPU the op runs the reference
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused():
    x, weights, _ = _case(2, (32, 16), 64, jnp.float32, (None, None))
    with pytest.raises(ValueError, match="must be \\[out_features, 64\\]"):
        linear_ops.project(x, [weights[0], weights[1][:, :32]])
    with pytest.raises(ValueError, match="2 weights but 1 biases"):
        linear_ops.project(x, weights, [None])
    with pytest.raises(ValueError, match="bias 0"):
        linear_ops.project(x, weights, [jnp.zeros(31), None])
    big = jnp.zeros((skinny_pallas.MAX_ROWS + 1, 64))
    with pytest.raises(ValueError, match="1 to 16 rows"):
        skinny_pallas.project(big, weights, interpret=True)
    with pytest.raises(ValueError, match="no input features"):
        skinny_pallas.project(jnp.zeros((1, 0)), [jnp.zeros((4, 0))], interpret=True)
    with pytest.raises(ValueError, match="block_n"):
        skinny_pallas.project(x, weights, blocking=skinny_pallas.Blocking(4, 64, 4, 3), interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("blocking", [None, skinny_pallas.Blocking(16, 32, 4, 2)])  # 200 columns: masked K blocks
def test_norm_project_matches_reference(dtype, unit_offset, blocking):
    x, weights, biases = _case(1, (48, 20, 7), 200, dtype, (None, dtype, jnp.float32), seed=3)
    x = x * 3.0 + 0.5  # an RMS far from 1, so that a missing or misplaced scale shows
    g = jnp.asarray(np.random.RandomState(4).uniform(0.5, 1.5, 200), dtype)
    got = skinny_pallas.norm_project(x, g, weights, biases, eps=1e-6, unit_offset=unit_offset, blocking=blocking,
                                     interpret=True)
    # The kernel never rounds the normalised row, so the oracle is the reference in float32 on the same
    # (already rounded) inputs; the bf16 outputs then differ by their own rounding.
    f32 = lambda a: None if a is None else a.astype(jnp.float32)  # noqa: E731
    want, _ = reference.norm_project(f32(x), None, f32(g), [f32(w) for w in weights],
                                     [None if b is None else f32(b.astype(dtype)) for b in biases], eps=1e-6,
                                     unit_offset=unit_offset)
    assert len(got) == 3
    for g_out, w_out in zip(got, want):
        assert g_out.shape == w_out.shape and g_out.dtype == dtype
        tol = 1e-5 if dtype == jnp.float32 else 2**-7
        np.testing.assert_allclose(np.asarray(g_out, np.float32), np.asarray(w_out), rtol=tol, atol=tol)


@pytest.mark.parametrize("rows", [1, 3])  # the one-launch kernel; the unfused ops (their references on CPU)
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_project_op_on_the_kernels(rows, with_residual):
    x, weights, biases = _case(rows, (32, 16), 64, jnp.float32, (jnp.float32, None), seed=5)
    residual = jnp.asarray(np.random.RandomState(6).randn(rows, 64), jnp.float32) if with_residual else None
    g = jnp.asarray(np.random.RandomState(7).uniform(0.5, 1.5, 64), jnp.float32)
    with registry.targeting(registry.Target.interpreted()), registry.recording() as chosen:
        got, got_sum = linear_ops.norm_project(x, residual, g, weights, biases, eps=1e-5)
    assert chosen == {"linear.norm_project": {"skinny" if rows == 1 else "ops"},
                      **({} if rows == 1 else {"norm.add_rms_norm": {"pallas"}, "linear.project": {"reference"}})}
    want, want_sum = linear_ops.norm_project(x, residual, g, weights, biases, eps=1e-5)  # the reference on CPU
    np.testing.assert_array_equal(np.asarray(got_sum), np.asarray(want_sum))
    for g_out, w_out in zip(got, want):
        np.testing.assert_allclose(np.asarray(g_out), np.asarray(w_out), rtol=1e-5, atol=1e-5)


def test_norm_project_refuses_bad_input():
    x, weights, _ = _case(1, (32, 16), 64, jnp.float32, (None, None))
    with pytest.raises(ValueError, match="norm weight \\(63,\\) must be \\[64\\]"):
        skinny_pallas.norm_project(x, jnp.ones(63), weights, eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="takes one row .*, not 2"):
        skinny_pallas.norm_project(jnp.zeros((2, 64)), jnp.ones(64), weights, eps=1e-6, interpret=True)


def test_default_blocking():
    one = skinny_pallas.default_blocking(1, 2048)
    assert (one.block_n, one.block_k) == (4, 1024)
    assert skinny_pallas.default_blocking(1, 40).block_k == 64  # never wider than the padded row
    several = skinny_pallas.default_blocking(8, 2048)
    assert several.block_n >= 16  # the tensor-core dot's minimum


def test_default_norm_blocking_takes_rows_up_to_2048_in_one_step():
    one_step = skinny_pallas.default_norm_blocking(2048)
    assert (one_step.block_n, one_step.block_k, one_step.num_stages) == (8, 2048, 1)
    assert skinny_pallas.default_norm_blocking(200).block_k == 256  # the padded row, masked
    assert skinny_pallas.default_norm_blocking(4096) == skinny_pallas.default_blocking(1, 4096)
    assert skinny_pallas.default_norm_blocking(2880) == skinny_pallas.default_blocking(1, 2880)
