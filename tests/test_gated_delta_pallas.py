"""The gated delta rule's Pallas kernels: in interpret mode they equal the token-by-token recurrence
(varlen steps of several chunks, sequences shorter than a chunk, an empty sequence, padding rows,
with and without initial states; one decay per head and one per key channel), the decode kernel
updates exactly its slots of the pool; ``supports`` refuses what the kernels do not take; both lower
for the GPU at Qwen3-Next's shapes; the ops pick them where Pallas runs."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.kernels import gated_delta
from jaxinfer.kernels import registry
from jaxinfer.kernels.gated_delta import chunked_pallas, recurrent_pallas, reference

S = jax.ShapeDtypeStruct
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
HEADS, DK, DV = 2, 16, 32
TOKENS = 200  # every step below packs its sequences into these rows: one compiled kernel per gate kind
STEPS = {
    # several chunks (70, 110), one token, an empty sequence, a partial last chunk; 14 padding rows
    "mixed": [70, 1, 0, 110, 5],
    # whole chunks, a short sequence, two empty ones last; 5 padding rows
    "whole-chunks": [64, 128, 3, 0, 0],
    # one sequence over four chunks, no padding
    "one-long": [200, 0, 0, 0, 0],
}


def _l2(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def _step(lengths, *, per_channel: bool, initial: bool, seed: int = 0, decay: float = 0.3):
    """A packed step of ``TOKENS`` rows: (q, k, v, g, beta, cu_seqlens, initial_state)."""
    rng = np.random.RandomState(seed)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), I32)
    q = jnp.asarray(_l2(rng.randn(TOKENS, HEADS, DK)) * DK ** -0.5, F32)
    k = jnp.asarray(_l2(rng.randn(TOKENS, HEADS, DK)), F32)
    v = jnp.asarray(rng.randn(TOKENS, HEADS, DV), F32)
    g = jnp.asarray(-np.abs(rng.randn(TOKENS, HEADS, *((DK,) if per_channel else ()))) * decay, F32)
    beta = jnp.asarray(1 / (1 + np.exp(-rng.randn(TOKENS, HEADS))), F32)
    state = rng.randn(len(lengths), HEADS, DK, DV) * 0.5 if initial else np.zeros((len(lengths), HEADS, DK, DV))
    return q, k, v, g, beta, cu, jnp.asarray(state, F32)


def _channel_step(state, q, k, v, g, beta):
    """``reference.recurrent_step`` with one decay per key channel: g [H, Dk]."""
    state = state * jnp.exp(g)[:, :, None]
    delta = beta[:, None] * (v - jnp.einsum("hkv,hk->hv", state, k))
    state = state + k[:, :, None] * delta[:, None, :]
    return jnp.einsum("hkv,hk->hv", state, q), state


@jax.jit
def _channel_reference(q, k, v, g, beta, cu_seqlens, initial_state):
    """``reference.gated_delta_rule`` with a per-channel gate g [T, H, Dk], token by token."""
    num_tokens = q.shape[0]
    rows = jnp.arange(num_tokens)
    seq = jnp.searchsorted(cu_seqlens[1:], rows, side="right")
    valid = rows < cu_seqlens[-1]
    first = valid & (rows == cu_seqlens[jnp.minimum(seq, cu_seqlens.shape[0] - 2)])

    def step(carry, xs):
        state, finals = carry
        q_t, k_t, v_t, g_t, b_t, s_t, valid_t, first_t = xs
        s_t = jnp.minimum(s_t, finals.shape[0] - 1)
        state = jnp.where(first_t, finals[s_t], state)
        out, new_state = _channel_step(state, q_t, k_t, v_t, g_t, b_t)
        state = jnp.where(valid_t, new_state, state)
        finals = jnp.where(valid_t, finals.at[s_t].set(state), finals)
        return (state, finals), jnp.where(valid_t, out, 0.0)

    init = (jnp.zeros(initial_state.shape[1:], F32), initial_state)
    (_, finals), outputs = jax.lax.scan(step, init, (q, k, v, g, beta, seq, valid, first))
    return outputs, finals


def _truth(*args):
    return (_channel_reference if args[3].ndim == 3 else reference.gated_delta_rule)(*args)


def _assert_close(got, want, tol=2e-5):
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


@pytest.mark.parametrize("per_channel", [False, True], ids=["head-gate", "channel-gate"])
def test_the_chunked_kernels_equal_the_recurrence(per_channel):
    """Each step through the op in interpret mode (the kernels serve it) == the token-by-token truth;
    padding rows are zeros and an empty sequence keeps its state."""
    for name, lengths in STEPS.items():
        for initial in (True, False):
            args = _step(lengths, per_channel=per_channel, initial=initial, seed=len(name))
            with registry.targeting(registry.Target.interpreted()), registry.recording() as chosen:
                got = gated_delta.gated_delta_rule(*args)
            assert chosen == {"gated_delta.gated_delta_rule": {"triton"}}
            _assert_close(got, _truth(*args))
            out, finals = map(np.asarray, got)
            np.testing.assert_array_equal(out[sum(lengths):], 0.0)
            for s, n in enumerate(lengths):
                if n == 0:
                    np.testing.assert_array_equal(finals[s], np.asarray(args[-1][s]))


def test_a_per_channel_gate_alike_on_every_channel_is_the_head_gate():
    """The per-channel path with g broadcast over Dk gives the per-head recurrence."""
    q, k, v, g, beta, cu, state = _step(STEPS["mixed"], per_channel=False, initial=True, seed=7)
    wide = jnp.broadcast_to(g[:, :, None], (*g.shape, DK))
    got = chunked_pallas.gated_delta_rule(q, k, v, wide, beta, cu, state, interpret=True)
    _assert_close(got, reference.gated_delta_rule(q, k, v, g, beta, cu, state))


def test_fast_per_channel_decay_stays_finite():
    """Gates of about -6 per token on some channels (a chunk decays by ~exp(-380), past float32's
    range when ``exp(G_i - G_j)`` is split as ``exp(G_i) exp(-G_j)``): still the recurrence."""
    q, k, v, g, beta, cu, state = _step(STEPS["one-long"], per_channel=True, initial=True, seed=3)
    g = g.at[:, :, :DK // 2].multiply(20.0)
    got = chunked_pallas.gated_delta_rule(q, k, v, g, beta, cu, state, interpret=True)
    assert all(np.isfinite(np.asarray(x)).all() for x in got)
    assert float(jnp.min(jnp.sum(g[:64], axis=0))) < -300
    _assert_close(got, _channel_reference(q, k, v, g, beta, cu, state))


def _decode(per_channel: bool, seed: int = 0):
    rng = np.random.RandomState(seed)
    num_slots, dv = 6, 64
    pool = jnp.asarray(rng.randn(num_slots, HEADS, DK, dv), F32)
    slots = jnp.asarray([3, -1, 0, 9], I32)  # a padding row; one past the pool; slots 1, 2, 4 and 5 untouched
    n = slots.shape[0]
    q = jnp.asarray(_l2(rng.randn(n, HEADS, DK)) * DK ** -0.5, F32)
    k = jnp.asarray(_l2(rng.randn(n, HEADS, DK)), F32)
    v = jnp.asarray(rng.randn(n, HEADS, dv), F32)
    g = jnp.asarray(-np.abs(rng.randn(n, HEADS, *((DK,) if per_channel else ()))), F32)
    beta = jnp.asarray(rng.rand(n, HEADS), F32)
    return pool, slots, q, k, v, g, beta


@pytest.mark.parametrize("per_channel", [False, True], ids=["head-gate", "channel-gate"])
def test_the_decode_kernel_updates_only_its_slots(per_channel):
    """Two Dv blocks per head: each sequence's output and state equal one recurrence step from its
    slot; the padding row outputs zeros; untouched slots keep their bits; a slot past the pool reads
    the last state and writes nothing (the reference's clamped read and dropped write)."""
    pool, slots, q, k, v, g, beta = _decode(per_channel)
    step = _channel_step if per_channel else reference.recurrent_step
    out, new_pool = recurrent_pallas.recurrent_update(pool, slots, q, k, v, g, beta, interpret=True, block_v=32)
    for row, slot in ((0, 3), (2, 0), (3, 5)):
        want_out, want_state = step(pool[slot], q[row], k[row], v[row], g[row], beta[row])
        np.testing.assert_allclose(np.asarray(out[row]), np.asarray(want_out), rtol=1e-6, atol=1e-6)
        if row != 3:
            np.testing.assert_allclose(np.asarray(new_pool[slot]), np.asarray(want_state), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
    for slot in (1, 2, 4, 5):
        np.testing.assert_array_equal(np.asarray(new_pool[slot]), np.asarray(pool[slot]))
    if not per_channel:  # the op serves it with the kernel where Pallas runs, with the reference's result
        with registry.targeting(registry.Target.interpreted()), registry.recording() as chosen:
            served = gated_delta.recurrent_update(pool, slots, q, k, v, g, beta)
        assert chosen == {"gated_delta.recurrent_update": {"triton"}}
        _assert_close(served, reference.recurrent_update(pool, slots, q, k, v, g, beta), tol=1e-6)


def _abstract_step(tokens, heads, dk, dv, seqs, *, gate=None, dtype=BF16):
    gate = (tokens, heads) if gate is None else gate
    return (S((tokens, heads, dk), dtype), S((tokens, heads, dk), dtype), S((tokens, heads, dv), dtype), S(gate, F32),
            S((tokens, heads), F32), S((seqs + 1,), I32), S((seqs, heads, dk, dv), F32))


def test_supports_refuses_what_the_kernels_do_not_take():
    step = _abstract_step(100, 2, 16, 32, 3)
    assert chunked_pallas.supports(*step)
    assert chunked_pallas.supports(*_abstract_step(100, 2, 16, 32, 3, gate=(100, 2, 16)))
    assert chunked_pallas.supports(*step, state_block_v=16, output_block_v=32)
    refused = [
        _abstract_step(100, 2, 24, 32, 3),  # Dk not a power of two
        _abstract_step(100, 2, 16, 48, 3),  # Dv not a power of two
        _abstract_step(100, 2, 8, 32, 3),  # below a tensor-core tile
        _abstract_step(100, 2, 256, 32, 3),  # wider than the measured tiles (the jnp path takes it)
        _abstract_step(0, 2, 16, 32, 3),  # no tokens
        _abstract_step(100, 2, 16, 32, 3, gate=(100, 2, 32)),  # a gate that is neither per head nor per channel
        (*step[:6], S((2, 2, 16, 32), F32)),  # initial states of another number of sequences
        (*step[:5], S((4,), F32), step[6]),  # float cu_seqlens
        (*step[:4], S((100, 3), F32), *step[5:]),  # beta of other heads
    ]
    for args in refused:
        assert not chunked_pallas.supports(*args), args
    assert not chunked_pallas.supports(*step, block_q=16)  # unknown option
    assert not chunked_pallas.supports(*step, state_block_v=64)  # wider than Dv
    with pytest.raises(ValueError, match="must be powers of two"):
        chunked_pallas.gated_delta_rule(*(jnp.zeros(a.shape, a.dtype) for a in refused[0]))

    pool, slots = S((8, 2, 16, 64), F32), S((4,), I32)
    decode = (pool, slots, S((4, 2, 16), BF16), S((4, 2, 16), BF16), S((4, 2, 64), BF16), S((4, 2), F32),
              S((4, 2), F32))
    assert recurrent_pallas.supports(*decode)
    assert recurrent_pallas.supports(*decode[:5], S((4, 2, 16), F32), decode[6], block_v=16)
    assert not recurrent_pallas.supports(S((8, 2, 48, 64), F32), *decode[1:])  # Dk not a power of two
    assert not recurrent_pallas.supports(pool, S((4,), F32), *decode[2:])  # float slots
    assert not recurrent_pallas.supports(pool, slots, *decode[2:5], S((4, 2, 8), F32), decode[6])  # gate width
    assert not recurrent_pallas.supports(*decode[:2], S((4, 2, 32), BF16), *decode[3:])  # q of another Dk
    assert not recurrent_pallas.supports(*decode, block_v=128)  # wider than Dv


def test_default_tiles_keep_the_state_pass_busy():
    assert chunked_pallas.default_tiles(4, 32, 128) == {"state_block_v": 64, "output_block_v": 64}  # 256 programs
    assert chunked_pallas.default_tiles(1, 32, 128)["state_block_v"] == 32  # one sequence: 128 programs of 32
    assert chunked_pallas.default_tiles(3, 32, 256)["state_block_v"] == 64
    assert chunked_pallas.default_tiles(1, 2, 16) == {"state_block_v": 16, "output_block_v": 16}
    assert recurrent_pallas.default_block_v(128, 128) == 64 and recurrent_pallas.default_block_v(16, 64) == 64


def _lower_for_gpu(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


_CHUNK_KERNELS = ("gated_delta_chunk_prepare", "gated_delta_chunk_states", "gated_delta_chunk_output")


@pytest.mark.parametrize("tokens, heads, dk, dv, seqs, per_channel", [
    (4096, 32, 128, 128, 4, False),  # Qwen3-Next's 32 value heads, a 4096-token step of 4 sequences
    (4096, 32, 128, 128, 3, True),  # the same with a per-channel (KDA) gate
    (100, 2, 16, 32, 2, False),  # small: one Dv block per program
])
def test_the_chunked_kernels_lower_for_the_gpu(tokens, heads, dk, dv, seqs, per_channel):
    gate = (tokens, heads, dk) if per_channel else (tokens, heads)
    text = _lower_for_gpu(chunked_pallas.gated_delta_rule, *_abstract_step(tokens, heads, dk, dv, seqs, gate=gate))
    assert all(name in text for name in _CHUNK_KERNELS)


@pytest.mark.parametrize("seqs, slots, heads, dk, dv, per_channel", [
    (64, 256, 32, 128, 128, False),  # Qwen3-Next decode: 64 sequences over a pool of 256 states
    (64, 256, 32, 128, 128, True),
    (3, 5, 2, 16, 32, False),
])
def test_the_decode_kernel_lowers_for_the_gpu(seqs, slots, heads, dk, dv, per_channel):
    gate = (seqs, heads, dk) if per_channel else (seqs, heads)
    text = _lower_for_gpu(recurrent_pallas.recurrent_update, S((slots, heads, dk, dv), F32), S((seqs,), I32),
                          S((seqs, heads, dk), BF16), S((seqs, heads, dk), BF16), S((seqs, heads, dv), BF16),
                          S(gate, F32), S((seqs, heads), F32))
    assert "gated_delta_recurrent_update" in text


HOPPER = registry.Target(platform="gpu", device_kind="NVIDIA H200", compute_capability="9.0", sm_count=132)


def test_the_ops_pick_the_kernels_where_pallas_runs():
    cpu = registry.Target.of_device(jax.devices("cpu")[0])
    step = [jnp.zeros(a.shape, a.dtype) for a in _abstract_step(100, 2, 16, 32, 2, dtype=F32)]
    narrow = [jnp.zeros(a.shape, a.dtype) for a in _abstract_step(100, 2, 8, 32, 2, dtype=F32)]  # Dk 8: refused
    pool = jnp.zeros((5, 2, 16, 32), F32)
    decode = (pool, jnp.zeros((3,), I32), jnp.zeros((3, 2, 16)), jnp.zeros((3, 2, 16)), jnp.zeros((3, 2, 32)),
              jnp.zeros((3, 2)), jnp.zeros((3, 2)))
    rule, update = gated_delta.gated_delta_rule_op, gated_delta.recurrent_update_op
    for target, kernel in ((HOPPER, "triton"), (registry.Target.interpreted(), "triton"), (cpu, None)):
        assert rule.choose(target, *step).name == (kernel or "chunked")
        assert rule.choose(target, *narrow).name == "chunked"
        assert update.choose(target, *decode).name == (kernel or "reference")
        assert update.choose(target, pool[..., :8, :], *decode[1:2], decode[2][..., :8], decode[3][..., :8],
                             *decode[4:]).name == "reference"
    # Traced (no run; a new function each time, so no trace is reused across targets): for the GPU
    # the calls go to the kernels, on this CPU to the jnp paths.
    for target, rule_name, update_name in ((HOPPER, "triton", "triton"), (None, "chunked", "reference")):
        with registry.targeting(target) if target else contextlib.nullcontext(), registry.recording() as chosen:
            jax.eval_shape(lambda *a: gated_delta.gated_delta_rule(*a), *step)
            jax.eval_shape(lambda *a: gated_delta.recurrent_update(*a), *decode)
        assert chosen == {"gated_delta.gated_delta_rule": {rule_name}, "gated_delta.recurrent_update": {update_name}}
