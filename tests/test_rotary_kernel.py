"""The fused q/k norm + RoPE + cache-write kernel (interpret mode, CPU) against its reference."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.kernels.attention import reference, rotary_pallas
from jaxinfer.kernels.attention.rotary_pallas import rotary_cache_write


def _case(num_tokens, heads, kv_heads, head_dim, rotary_dim, dtype, seed=0):
    rng = np.random.RandomState(seed)
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    q = cast(rng.randn(num_tokens, heads, head_dim))
    k = cast(rng.randn(num_tokens, kv_heads, head_dim))
    v = cast(rng.randn(num_tokens, kv_heads, head_dim))
    angles = rng.rand(num_tokens, rotary_dim // 2) * 6.0
    cos = jnp.asarray(np.cos(np.concatenate([angles, angles], 1)), jnp.float32)
    sin = jnp.asarray(np.sin(np.concatenate([angles, angles], 1)), jnp.float32)
    cache_shape = (kv_heads, 6, 4, head_dim)  # 6 pages of 4 slots
    k_cache, v_cache = cast(rng.randn(*cache_shape)), cast(rng.randn(*cache_shape))
    slots = rng.permutation(24)[:num_tokens].astype(np.int32)
    slots[-1] = -1  # a padding token: nothing written
    norms = dict(q_norm=cast(1 + 0.3 * rng.randn(head_dim)), k_norm=cast(1 + 0.3 * rng.randn(head_dim)))
    return (q, k, v, cos, sin, k_cache, v_cache, jnp.asarray(slots)), norms


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim, rotary_dim, qk_norm", [
    (8, 2, 64, 64, True),     # Qwen3: per-head q/k norm, full rotation
    (4, 4, 32, 32, False),    # Llama: no norm
    (8, 2, 64, 32, False),    # partial rotary: the last 32 dims pass through
    (6, 2, 32, 32, True),     # 6 heads: not a power of two, the reference runs
])
# Few tokens take one program per (token, KV head), more one per token; the token counts differ so
# that each layout gets its own trace.
@pytest.mark.parametrize("num_tokens, split_heads_below", [(5, 256), (7, 4)])
def test_matches_reference(dtype, heads, kv_heads, head_dim, rotary_dim, qk_norm, num_tokens, split_heads_below,
                           monkeypatch):
    monkeypatch.setattr(rotary_pallas, "SPLIT_HEADS_BELOW", split_heads_below)
    args, norms = _case(num_tokens, heads, kv_heads, head_dim, rotary_dim, dtype)
    options = dict(norms, norm_eps=1e-6) if qk_norm else {}
    want = reference.rotary_cache_write(*args, **options)
    copies = [jnp.array(a) for a in args]  # the kernel donates its caches
    got = rotary_cache_write(*copies, interpret=True, **options)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == jnp.float32 else dict(rtol=0, atol=1.6e-2)
    for name, g, w in zip(("q", "k_cache", "v_cache"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), err_msg=name, **tol)
    # The padding token's slot and every untouched slot keep the old cache contents exactly.
    written = np.asarray(args[7])[np.asarray(args[7]) >= 0]
    untouched = np.setdiff1d(np.arange(24), written)
    for cache, old in ((got[1], args[5]), (got[2], args[6])):
        flat, flat_old = np.asarray(cache).reshape(kv_heads, 24, -1), np.asarray(old).reshape(kv_heads, 24, -1)
        np.testing.assert_array_equal(flat[:, untouched], flat_old[:, untouched])


@pytest.mark.parametrize("op", [reference.rotary_cache_write, functools.partial(rotary_cache_write, interpret=True)])
def test_rejects_a_lone_norm_weight(op):
    args, norms = _case(3, 4, 2, 32, 32, jnp.float32)
    with pytest.raises(ValueError, match="together"):
        op(*args, q_norm=norms["q_norm"])
