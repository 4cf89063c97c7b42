"""Tile loads shared by the Pallas (Triton lowering) kernels."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu


def load_tile(view, n0, k0, *, n_size: int, k_size: int, mask_n: bool, mask_k: bool):
    """A ``[block_n, block_k]`` ``view`` of a matrix at rows ``n0``, columns ``k0``, loaded with zeros
    past ``n_size`` rows / ``k_size`` columns where ``mask_n`` / ``mask_k`` (a plain load otherwise,
    which Triton vectorises best)."""
    if not (mask_n or mask_k):
        return view[...]
    shape = view.shape
    mask = jnp.ones(shape, jnp.bool_)
    if mask_n:
        mask &= (n0 + lax.broadcasted_iota(jnp.int32, shape, 0)) < n_size
    if mask_k:
        mask &= (k0 + lax.broadcasted_iota(jnp.int32, shape, 1)) < k_size
    return plgpu.load(view, mask=mask, other=0.0)
