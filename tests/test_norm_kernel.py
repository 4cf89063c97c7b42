"""The residual add + RMSNorm kernel (interpret mode, CPU) against its reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.kernels.norm import reference
from jaxinfer.kernels.norm.rms_norm_pallas import add_rms_norm


def _case(rows, hidden, dtype, weight_dtype=None, seed=0):
    rng = np.random.RandomState(seed)
    x = jnp.asarray(rng.randn(rows, hidden) * 3, dtype)
    residual = jnp.asarray(rng.randn(rows, hidden), dtype)
    weight = jnp.asarray(1 + 0.3 * rng.randn(hidden), weight_dtype or dtype)
    return x, residual, weight


@pytest.mark.parametrize("rows, hidden", [(1, 64), (5, 96), (40, 32)])  # 96: not a power of two; 40 rows: 4 programs
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("flavour", ["plain", "unit_offset", "float32_weight"])
@pytest.mark.parametrize("with_residual", [True, False])
def test_matches_reference(rows, hidden, dtype, flavour, with_residual):
    x, residual, weight = _case(rows, hidden, dtype)
    residual = residual if with_residual else None
    options = {flavour: True} if flavour != "plain" else {}
    ref_normed, ref_sum = reference.add_rms_norm(x, residual, weight, 1e-6, **options)
    normed, summed = add_rms_norm(x, residual, weight, 1e-6, interpret=True, **options)
    assert normed.dtype == ref_normed.dtype and summed.dtype == dtype
    # The sum is exact; the norm agrees to float32 rounding, bf16 to one unit in the last place: on
    # CPU, XLA may keep the bf16 sum in float32 inside the interpreted kernel (excess precision).
    np.testing.assert_array_equal(np.asarray(summed, np.float32), np.asarray(ref_sum, np.float32))
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2**-7, atol=2**-7)
    np.testing.assert_allclose(np.asarray(normed, np.float32), np.asarray(ref_normed, np.float32), **tolerance)


def test_leading_axes_and_weight_dtype_promotion():
    # A float32 weight on bf16 activations promotes, as the reference's ``weight * x`` does.
    x, residual, weight = _case(6, 64, jnp.bfloat16, weight_dtype=jnp.float32)
    x, residual = x.reshape(2, 3, 64), residual.reshape(2, 3, 64)
    ref_normed, _ = reference.add_rms_norm(x, residual, weight, 1e-5)
    normed, summed = add_rms_norm(x, residual, weight, 1e-5, interpret=True)
    assert normed.shape == x.shape and summed.shape == x.shape and normed.dtype == ref_normed.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(normed), np.asarray(ref_normed), rtol=2**-7, atol=2**-7)


def test_mixed_dtypes_are_refused():
    x, residual, weight = _case(2, 32, jnp.bfloat16)
    with pytest.raises(ValueError, match="one dtype"):
        add_rms_norm(x, residual.astype(jnp.float32), weight, 1e-6, interpret=True)


def test_no_rows():
    x, residual, weight = _case(0, 32, jnp.float32)
    normed, summed = add_rms_norm(x, residual, weight, 1e-6, interpret=True)
    assert normed.shape == summed.shape == (0, 32)
