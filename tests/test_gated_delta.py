"""The gated delta rule: the chunked form equals the token-by-token recurrence over packed sequences
(varlen, an empty sequence, padding rows, initial states), and both follow transformers'
Qwen3-Next reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxinfer.kernels import gated_delta
from jaxinfer.kernels import registry
from jaxinfer.kernels.gated_delta import chunked, reference


def _l2(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)  # HF's l2norm (eps inside the root)


def _packed(lengths, pad=7, heads=3, dk=8, dv=6, seed=0):
    rng = np.random.RandomState(seed)
    t = sum(lengths) + pad
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    q = jnp.asarray(_l2(rng.randn(t, heads, dk)) * dk ** -0.5, jnp.float32)
    k = jnp.asarray(_l2(rng.randn(t, heads, dk)), jnp.float32)
    v = jnp.asarray(rng.randn(t, heads, dv), jnp.float32)
    g = jnp.asarray(-np.abs(rng.randn(t, heads)) * 0.3, jnp.float32)
    beta = jnp.asarray(1 / (1 + np.exp(-rng.randn(t, heads))), jnp.float32)
    state = jnp.asarray(rng.randn(len(lengths), heads, dk, dv) * 0.5, jnp.float32)
    return q, k, v, g, beta, cu, state


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_equals_the_recurrence(chunk):
    lengths = [70, 1, 0, 130, 5]  # several chunks, one token, an empty sequence, a partial chunk
    args = _packed(lengths)
    want_out, want_state = reference.gated_delta_rule(*args)
    got_out, got_state = jax.jit(lambda *a: chunked.gated_delta_rule(*a, chunk=chunk))(*args)
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_state), np.asarray(want_state), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(want_out[sum(lengths):]), 0.0)  # padding rows
    np.testing.assert_array_equal(np.asarray(want_state[2]), np.asarray(args[-1][2]))  # no tokens: unchanged


def test_a_continued_sequence_equals_one_pass():
    """Prefill in two calls, the second from the first's final state, equals one call."""
    q, k, v, g, beta, _, state = _packed([100], pad=0, seed=3)
    whole, whole_state = chunked.gated_delta_rule(q, k, v, g, beta, jnp.asarray([0, 100], jnp.int32), state)
    first, mid = chunked.gated_delta_rule(q[:37], k[:37], v[:37], g[:37], beta[:37], jnp.asarray([0, 37], jnp.int32),
                                          state)
    second, end = chunked.gated_delta_rule(q[37:], k[37:], v[37:], g[37:], beta[37:],
                                           jnp.asarray([0, 63], jnp.int32), mid)
    np.testing.assert_allclose(np.concatenate([first, second]), np.asarray(whole), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(end), np.asarray(whole_state), rtol=1e-5, atol=1e-5)
    # And token by token (decode) from the same state.
    s, outs = state[0], []
    for t in range(100):
        out, s = gated_delta.recurrent_step(s, q[t], k[t], v[t], g[t], beta[t])
        outs.append(out)
    np.testing.assert_allclose(np.stack(outs), np.asarray(whole), rtol=1e-5, atol=1e-5)


def test_both_forms_follow_transformers():
    from transformers.models.qwen3_next.modeling_qwen3_next import (torch_chunk_gated_delta_rule,
                                                                    torch_recurrent_gated_delta_rule)

    rng = np.random.RandomState(1)
    t, heads, dk, dv = 150, 2, 16, 8
    q, k = (rng.randn(1, t, heads, dk).astype(np.float32) for _ in range(2))
    v = rng.randn(1, t, heads, dv).astype(np.float32)
    g = (-np.abs(rng.randn(1, t, heads)) * 0.3).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.randn(1, t, heads)))).astype(np.float32)
    state = (rng.randn(1, heads, dk, dv) * 0.3).astype(np.float32)
    ours = [jnp.asarray(x) for x in (_l2(q[0]) * dk ** -0.5, _l2(k[0]), v[0], g[0], beta[0])]
    cu = jnp.asarray([0, t], jnp.int32)
    for hf_fn, our_fn in ((torch_chunk_gated_delta_rule, chunked.gated_delta_rule),
                          (torch_recurrent_gated_delta_rule, reference.gated_delta_rule)):
        want_out, want_state = hf_fn(*map(torch.tensor, (q, k, v, g, beta)), initial_state=torch.tensor(state),
                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
        got_out, got_state = our_fn(*ours, cu, jnp.asarray(state))
        np.testing.assert_allclose(np.asarray(got_out), want_out[0].numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got_state), want_state.numpy(), rtol=1e-5, atol=1e-5)


def test_the_op_defaults_to_the_chunked_form():
    with registry.recording() as chosen:
        gated_delta.gated_delta_rule(*_packed([5, 9]))
    assert chosen == {"gated_delta.gated_delta_rule": {"chunked"}}


def test_the_slot_pool_update_reads_and_writes_only_its_slots():
    rng = np.random.RandomState(4)
    heads, dk, dv = 2, 8, 4
    pool = jnp.asarray(rng.randn(5, heads, dk, dv), jnp.float32)
    slots = jnp.asarray([3, -1, 0], jnp.int32)
    q, k = (jnp.asarray(_l2(rng.randn(3, heads, dk)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.randn(3, heads, dv), jnp.float32)
    g = jnp.asarray(-np.abs(rng.randn(3, heads)), jnp.float32)
    beta = jnp.asarray(rng.rand(3, heads), jnp.float32)
    out, new_pool = gated_delta.recurrent_update(pool, slots, q, k, v, g, beta)
    for row, slot in ((0, 3), (2, 0)):
        want_out, want_state = gated_delta.recurrent_step(pool[slot], q[row], k[row], v[row], g[row], beta[row])
        np.testing.assert_allclose(np.asarray(out[row]), np.asarray(want_out), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(new_pool[slot]), np.asarray(want_state), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
    for slot in (1, 2, 4):  # untouched
        np.testing.assert_array_equal(np.asarray(new_pool[slot]), np.asarray(pool[slot]))
