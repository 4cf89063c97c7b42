"""The Pallas routing kernel (interpret mode, CPU) against the plain-jnp reference routers."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.kernels import moe, registry
from jaxinfer.kernels.moe import reference, router_pallas

ROUTER_OPTIONS = {
    "softmax_topk": dict(router="softmax_topk", norm_topk_prob=True),
    # norm_eps belongs to the sigmoid router's normalisation alone: the softmax router ignores it.
    "softmax_topk_given_eps": dict(router="softmax_topk", norm_topk_prob=True, norm_eps=1e-3),
    "softmax_topk_unnormalised": dict(router="softmax_topk", norm_topk_prob=False),
    "topk_softmax": dict(router="topk_softmax"),
    "sigmoid_bias": dict(router="sigmoid_bias", norm_topk_prob=True, norm_eps=1e-20, routed_scaling_factor=2.5),
}


@pytest.mark.parametrize("name", sorted(ROUTER_OPTIONS))
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 128, 8), (5, 32, 4), (40, 24, 6), (3, 256, 8)])
def test_matches_reference(name, num_tokens, num_experts, top_k):
    # Token counts that do and do not fill a block, expert counts that are not powers of two (24)
    # and k that is not (6).
    rng = np.random.RandomState(num_tokens + num_experts)
    logits = jnp.asarray(rng.randn(num_tokens, num_experts), jnp.float32)
    options = dict(ROUTER_OPTIONS[name], top_k=top_k)
    if name == "sigmoid_bias":
        options["correction_bias"] = jnp.asarray(0.3 * rng.randn(num_experts), jnp.float32)
    ref_weights, ref_ids = reference.route(logits, **options)
    weights, ids = router_pallas.route(logits, interpret=True, **options)
    assert ids.dtype == jnp.int32 and ids.shape == ref_ids.shape == (num_tokens, top_k)
    # Exact: each row's k-th and (k + 1)-th scores here are at least 6e-6 apart (sigmoid_bias, 40 x 24),
    # some 30 float32 ulps, more than the two implementations' rounding can differ.
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(ref_weights), rtol=1e-6, atol=1e-7)


def test_ties_go_to_the_lower_expert():
    # bf16 logits tie often; the choice among equal scores must match jax.lax.top_k's.
    logits = jnp.asarray([[0.5, 1.0, 1.0, 0.25, 1.0, -2.0, 0.5, 0.5]], jnp.bfloat16)
    for top_k in (2, 4, 5):
        ref_weights, ref_ids = reference.route(logits, router="softmax_topk", top_k=top_k)
        weights, ids = router_pallas.route(logits, router="softmax_topk", top_k=top_k, interpret=True)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
        np.testing.assert_allclose(np.asarray(weights), np.asarray(ref_weights), rtol=1e-6)


def test_grouped_top_k_runs_the_reference():
    logits = jnp.asarray(np.random.RandomState(0).randn(4, 16), jnp.float32)
    options = dict(router="sigmoid_bias", top_k=3, n_group=4, topk_group=2)
    for got, want in zip(router_pallas.route(logits, interpret=True, **options), reference.route(logits, **options)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_rejects_bad_arguments():
    logits = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="unknown router"):
        router_pallas.route(logits, router="softmax", top_k=2, interpret=True)
    with pytest.raises(ValueError, match="top_k"):
        router_pallas.route(logits, router="softmax_topk", top_k=9, interpret=True)


def test_gpu_dispatch_takes_the_kernel_where_it_measured_faster():
    gpu = registry.Target(platform="gpu", compute_capability="9.0", sm_count=132)
    chosen = [shape for shape in ((1, 128), (8, 128), (64, 32), (4096, 32), (4096, 128))
              if moe.route_op.choose(gpu, jnp.zeros(shape, jnp.float32), router="softmax_topk",
                                     top_k=2).name == "router"]
    assert chosen == [(1, 128), (4096, 128)]
    with registry.force("moe.route", "router"):  # forcing skips the preference, not the support
        assert moe.route_op.choose(gpu, jnp.zeros((8, 128)), router="softmax_topk", top_k=2).name == "router"