"""Kimi Delta Attention: the chunked form equals the token-by-token recurrence over packed sequences
(varlen, an empty sequence, padding rows, initial states, decays large enough to overflow a
factored ``exp(G_i) exp(-G_j)``), and both follow transformers' Kimi Linear reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxinfer.kernels import kda
from jaxinfer.kernels import registry
from jaxinfer.kernels.kda import chunked, reference


_reference = jax.jit(reference.kda)
_chunked = jax.jit(chunked.kda, static_argnames=("chunk", "sub_chunk"))
_step = jax.jit(kda.recurrent_step)


def _l2(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)  # HF's l2norm (eps inside the root)


def _decay(rng, shape, scale):
    """KDA's log-decay: -exp(A_log) softplus(x), per channel (mean about -0.8 * scale)."""
    return (-scale * np.log1p(np.exp(rng.randn(*shape)))).astype(np.float32)


def _packed(lengths, pad=7, heads=3, dk=8, dv=6, seed=0, decay=0.3):
    rng = np.random.RandomState(seed)
    t = sum(lengths) + pad
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    q = jnp.asarray(_l2(rng.randn(t, heads, dk)) * dk ** -0.5, jnp.float32)
    k = jnp.asarray(_l2(rng.randn(t, heads, dk)), jnp.float32)
    v = jnp.asarray(rng.randn(t, heads, dv), jnp.float32)
    g = jnp.asarray(_decay(rng, (t, heads, dk), decay))
    beta = jnp.asarray(1 / (1 + np.exp(-rng.randn(t, heads))), jnp.float32)
    state = jnp.asarray(rng.randn(len(lengths), heads, dk, dv) * 0.5, jnp.float32)
    return q, k, v, g, beta, cu, state


@pytest.mark.parametrize("chunk,sub_chunk", [(16, 1), (64, 4)])
def test_chunked_equals_the_recurrence(chunk, sub_chunk):
    lengths = [70, 1, 0, 130, 5]  # several chunks, one token, an empty sequence, a partial chunk
    args = _packed(lengths)
    want_out, want_state = _reference(*args)
    got_out, got_state = _chunked(*args, chunk=chunk, sub_chunk=sub_chunk)
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_state), np.asarray(want_state), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(want_out[sum(lengths):]), 0.0)  # padding rows
    np.testing.assert_array_equal(np.asarray(got_out[sum(lengths):]), 0.0)
    np.testing.assert_array_equal(np.asarray(want_state[2]), np.asarray(args[-1][2]))  # no tokens: unchanged
    np.testing.assert_array_equal(np.asarray(got_state[2]), np.asarray(args[-1][2]))


def test_large_decays_stay_finite_and_exact():
    """About -5 per token per channel (some channels near 0): a chunk's cumulative decay reaches
    hundreds, far past float32's exp range, yet the chunked form matches the recurrence."""
    q, k, v, g, beta, cu, state = _packed([150], pad=0, heads=2, dk=16, dv=8, seed=5, decay=7.0)
    g = g.at[:, :, :3].multiply(0.01)  # slow channels keep a long memory next to the fast ones
    assert float(-jnp.sum(g[:64], axis=0).min()) > 200  # exp(-G) would overflow within one chunk
    args = (q, k, v, g, beta, cu, state)
    want_out, want_state = _reference(*args)
    got_out, got_state = _chunked(*args)
    assert np.isfinite(np.asarray(got_out)).all() and np.isfinite(np.asarray(got_state)).all()
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_state), np.asarray(want_state), rtol=1e-5, atol=1e-5)


def test_a_continued_sequence_equals_one_pass():
    """Prefill in two calls, the second from the first's final state, equals one call (each call
    gets all 150 rows, those past its tokens as padding), and equals decoding token by token."""
    q, k, v, g, beta, _, state = _packed([150], pad=0, heads=2, dk=16, dv=8, seed=3)
    cu = lambda n: jnp.asarray([0, n], jnp.int32)  # noqa: E731
    whole, whole_state = _chunked(q, k, v, g, beta, cu(150), state)
    first, mid = _chunked(q, k, v, g, beta, cu(37), state)
    second, end = _chunked(*(jnp.roll(x, -37, axis=0) for x in (q, k, v, g, beta)), cu(113), mid)
    np.testing.assert_allclose(np.concatenate([first[:37], second[:113]]), np.asarray(whole), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(end), np.asarray(whole_state), rtol=1e-5, atol=1e-5)
    rows = [np.asarray(x) for x in (q, k, v, g, beta)]
    s, outs = state[0], []
    for t in range(150):
        out, s = _step(s, *(x[t] for x in rows))
        outs.append(out)
    np.testing.assert_allclose(np.stack(outs), np.asarray(whole), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(s), np.asarray(whole_state[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decay", [0.3, 7.0])
def test_both_forms_follow_transformers(decay):
    from transformers.models.kimi_linear.modeling_kimi_linear import (chunk_kimi_delta_attention,
                                                                      recurrent_kimi_delta_attention)

    rng = np.random.RandomState(1)
    t, heads, dk, dv = 150, 2, 16, 8
    q, k = (rng.randn(1, t, heads, dk).astype(np.float32) for _ in range(2))
    v = rng.randn(1, t, heads, dv).astype(np.float32)
    g = _decay(rng, (1, t, heads, dk), decay)
    beta = (1 / (1 + np.exp(-rng.randn(1, t, heads)))).astype(np.float32)
    state = (rng.randn(1, heads, dk, dv) * 0.3).astype(np.float32)
    # HF L2-normalises q and k and scales q by Dk ** -0.5 inside; ours takes them done.
    ours = [jnp.asarray(x) for x in (_l2(q[0]) * dk ** -0.5, _l2(k[0]), v[0], g[0], beta[0])]
    cu = jnp.asarray([0, t], jnp.int32)
    for hf_fn, our_fn in ((chunk_kimi_delta_attention, chunked.kda), (recurrent_kimi_delta_attention, reference.kda)):
        want_out, want_state = hf_fn(*map(torch.tensor, (q, k, v, g, beta)), initial_state=torch.tensor(state),
                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
        got_out, got_state = {chunked.kda: _chunked, reference.kda: _reference}[our_fn](*ours, cu, jnp.asarray(state))
        np.testing.assert_allclose(np.asarray(got_out), want_out[0].numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got_state), want_state.numpy(), rtol=1e-5, atol=1e-5)


def test_the_op_defaults_to_the_chunked_form():
    with registry.recording() as chosen:  # the choice is made while tracing
        jax.eval_shape(kda.kda, *_packed([5, 9]))
    assert chosen == {"kda.kda": {"chunked"}}
    with registry.recording() as chosen:
        jax.eval_shape(kda.recurrent_update, jnp.zeros((2, 3, 8, 6)), jnp.asarray([1], jnp.int32),
                       *(x[:1] for x in _packed([1])[:5]))
    assert chosen == {"kda.recurrent_update": {"reference"}}


def test_the_slot_pool_update_reads_and_writes_only_its_slots():
    rng = np.random.RandomState(4)
    heads, dk, dv = 2, 8, 4
    pool = jnp.asarray(rng.randn(5, heads, dk, dv), jnp.float32)
    slots = jnp.asarray([3, -1, 0], jnp.int32)
    q, k = (jnp.asarray(_l2(rng.randn(3, heads, dk)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.randn(3, heads, dv), jnp.float32)
    g = jnp.asarray(_decay(rng, (3, heads, dk), 1.0))
    beta = jnp.asarray(rng.rand(3, heads), jnp.float32)
    out, new_pool = jax.jit(kda.recurrent_update)(pool, slots, q, k, v, g, beta)
    for row, slot in ((0, 3), (2, 0)):
        want_out, want_state = _step(pool[slot], q[row], k[row], v[row], g[row], beta[row])
        np.testing.assert_allclose(np.asarray(out[row]), np.asarray(want_out), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(new_pool[slot]), np.asarray(want_state), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
    for slot in (1, 2, 4):  # untouched
        np.testing.assert_array_equal(np.asarray(new_pool[slot]), np.asarray(pool[slot]))


def test_the_gated_delta_kernels_serve_kda_where_pallas_runs():
    """The per-channel gate path of the gated delta rule's Pallas kernels, in interpret mode, is KDA."""
    args = _packed([20, 0, 45], pad=3, heads=2, dk=16, dv=16, seed=5)
    with registry.targeting(registry.Target.interpreted()), registry.recording() as chosen:
        got_out, got_state = kda.kda(*args)
    assert chosen == {"kda.kda": {"triton"}}
    want_out, want_state = reference.kda(*args)
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_state), np.asarray(want_state), rtol=1e-5, atol=1e-5)
    pool, slots = args[-1], jnp.asarray([2, -1], jnp.int32)
    step = [x[:2] for x in args[:5]]
    with registry.targeting(registry.Target.interpreted()), registry.recording() as chosen:
        got = kda.recurrent_update(pool, slots, *step)
    assert chosen == {"kda.recurrent_update": {"triton"}}
    for a, b in zip(got, reference.recurrent_update(pool, slots, *step)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
