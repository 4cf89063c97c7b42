"""Lightning attention (MiniMax-Text-01): the chunked form and the Pallas kernels (interpret mode)
equal the token-by-token recurrence over packed sequences (varlen, an empty sequence, padding rows,
initial states), prefill continues across calls and into decode, the slot pool update touches only
its slots, the kernels lower for the GPU, and the ops with the layer's glue reproduce transformers'
``MiniMaxLightningAttention`` prefill and decode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxinfer.kernels import lightning
from jaxinfer.kernels import registry
from jaxinfer.kernels.lightning import chunked, chunked_pallas, recurrent_pallas, reference

S = jax.ShapeDtypeStruct
VARLEN = [70, 1, 0, 130, 5]  # several chunks, one token, an empty sequence, partial chunks
SHORT = [40, 1, 0, 17, 5]  # the same cases at interpret-mode size (chunks of 16)
_reference = jax.jit(reference.lightning_attention)  # compiled once per shape for the whole file


def _silu(x):
    return x / (1 + np.exp(-x))


def _slopes(heads):
    """From a steep 2.0 (weights underflow within a chunk) down to 1e-5 (MiniMax's last layer)."""
    return jnp.asarray(np.geomspace(2.0, 1e-5, heads), jnp.float32)


def _packed(lengths, pad=7, heads=3, dk=8, dv=6, seed=0, dtype=jnp.float32, initial=True):
    rng = np.random.RandomState(seed)
    t = sum(lengths) + pad
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    q, k, v = (jnp.asarray(_silu(rng.randn(t, heads, d)), dtype) for d in (dk, dk, dv))
    state = rng.randn(len(lengths), heads, dk, dv) * 0.5 if initial else np.zeros((len(lengths), heads, dk, dv))
    return q, k, v, _slopes(heads), cu, jnp.asarray(state, jnp.float32)


def _close(got, want, tol=1e-5):
    """Equal up to float32 rounding, relative to the largest value (states grow like sums of k^T v)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, float(np.abs(want).max())))


def _traced(fn):
    """``fn`` compiled afresh: its op calls resolve (and are recorded) when this wrapper is traced,
    under the caller's target, and no other wrapper shares its compiled programs."""
    return jax.jit(lambda *args: fn(*args))


def _check_varlen(got_out, got_state, args, lengths):
    want_out, want_state = _reference(*args)
    _close(got_out, want_out)
    _close(got_state, want_state)
    np.testing.assert_array_equal(np.asarray(got_out[sum(lengths):]), 0.0)  # padding rows
    np.testing.assert_array_equal(np.asarray(got_state[2]), np.asarray(args[-1][2]))  # no tokens: unchanged


@pytest.mark.parametrize("initial", [True, False])
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_equals_the_recurrence(chunk, initial):
    args = _packed(VARLEN, initial=initial)
    got_out, got_state = chunked.lightning_attention(*args, chunk=chunk)
    _check_varlen(got_out, got_state, args, VARLEN)


def test_the_recurrence_is_the_definition():
    """The reference against a direct sum, per sequence of a packed step (float64 numpy):
    o_t = sum_{j <= t} exp(-s (t - j)) (q_t . k_j) v_j + exp(-s (t + 1)) q_t S_0."""
    args = _packed(VARLEN)
    out, final = _reference(*args)
    q, k, v, s, cu, state = (np.asarray(x, np.float64) for x in args)
    for seq in (0, 3):
        rows = slice(int(cu[seq]), int(cu[seq + 1]))
        t = np.arange(VARLEN[seq])
        gap = t[:, None] - t[None, :]
        weights = np.where(gap >= 0, np.exp(-s[:, None, None] * np.maximum(gap, 0)), 0.0)  # [H, T, T]
        want = (np.einsum("hij,ihk,jhk,jhv->ihv", weights, q[rows], k[rows], v[rows], optimize=True)
                + np.einsum("ih,ihk,hkv->ihv", np.exp(-s[None, :] * (t[:, None] + 1)), q[rows], state[seq]))
        _close(out[rows], want)
        want_final = (np.exp(-s * len(t))[:, None, None] * state[seq]
                      + np.einsum("hj,jhk,jhv->hkv", weights[:, -1], k[rows], v[rows]))
        _close(final[seq], want_final)


def test_a_continued_step_equals_one_pass():
    """A step's sequences prefilled in two calls (each sequence's first rows, then the rest from the
    first call's final states; both packed and padded to the step's shape) equal one call, which
    equals decoding token by token from the initial state."""
    q, k, v, slope, cu, state = _packed(VARLEN)
    lengths = np.asarray(VARLEN)
    split = np.asarray([37, 1, 0, 64, 2])  # sequence 1 has nothing left for the second call

    def part(counts, skip):
        """Rows ``skip[s]`` to ``skip[s] + counts[s]`` of each sequence, packed -> (row ids, arguments)."""
        rows = np.concatenate([np.arange(n) + o + b for n, o, b in zip(counts, skip, np.asarray(cu[:-1]))])
        take = lambda x: jnp.pad(x[rows], ((0, q.shape[0] - len(rows)), (0, 0), (0, 0)))  # noqa: E731
        return rows, (take(q), take(k), take(v), slope, jnp.asarray(np.concatenate([[0], np.cumsum(counts)]),
                                                                       jnp.int32))

    whole, whole_state = chunked.lightning_attention(q, k, v, slope, cu, state, chunk=16)
    first_rows, first_args = part(split, np.zeros_like(split))
    first, mid = chunked.lightning_attention(*first_args, state, chunk=16)
    second_rows, second_args = part(lengths - split, split)
    second, end = chunked.lightning_attention(*second_args, mid, chunk=16)
    got = np.zeros(whole.shape, np.float32)
    got[first_rows], got[second_rows] = first[:len(first_rows)], second[:len(second_rows)]
    _close(got, whole)
    _close(end, whole_state)
    step = jax.jit(lightning.recurrent_step)
    s, outs = state[0], []
    for t in range(VARLEN[0]):
        out, s = step(s, q[t], k[t], v[t], slope)
        outs.append(out)
    _close(np.stack(outs), whole[:VARLEN[0]])
    _close(s, whole_state[0])


def _pool_case(seed=4, heads=2, dk=16, dv=32):
    rng = np.random.RandomState(seed)
    pool = jnp.asarray(rng.randn(5, heads, dk, dv), jnp.float32)
    slots = jnp.asarray([3, -1, 0], jnp.int32)
    q, k, v = (jnp.asarray(_silu(rng.randn(3, heads, d)), jnp.float32) for d in (dk, dk, dv))
    return pool, slots, q, k, v, _slopes(heads)


@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_the_slot_pool_update_reads_and_writes_only_its_slots(kernel):
    pool, slots, q, k, v, slope = _pool_case()
    if kernel == "triton":
        assert recurrent_pallas.supports(pool, slots, q, k, v, slope)
        out, new_pool = recurrent_pallas.recurrent_update(pool, slots, q, k, v, slope, interpret=True, block_v=16)
    else:
        out, new_pool = _traced(lightning.recurrent_update)(pool, slots, q, k, v, slope)
    for row, slot in ((0, 3), (2, 0)):
        want_out, want_state = lightning.recurrent_step(pool[slot], q[row], k[row], v[row], slope)
        _close(out[row], want_out, 1e-6)
        _close(new_pool[slot], want_state, 1e-6)
    np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
    for slot in (1, 2, 4):  # untouched
        np.testing.assert_array_equal(np.asarray(new_pool[slot]), np.asarray(pool[slot]))


@pytest.mark.parametrize("dtype, initial", [(jnp.float32, True), (jnp.float32, False), (jnp.bfloat16, True)])
def test_prefill_kernel_equals_the_recurrence(dtype, initial):
    """Interpret mode: chunks of 16 (a sequence of 40 rows is 3 chunks, the last partial), two value
    blocks of 16; bf16 inputs are widened in the kernel as the reference widens them."""
    args = _packed(SHORT, pad=3, heads=2, dk=16, dv=32, dtype=dtype, initial=initial)
    assert chunked_pallas.supports(*args, chunk=16, block_v=16)
    got_out, got_state = chunked_pallas.lightning_attention(*args, interpret=True, chunk=16, block_v=16)
    widened = tuple(x.astype(jnp.float32) for x in args[:3]) + args[3:]  # the reference's own first step
    _check_varlen(got_out, got_state, widened, SHORT)


def test_the_ops_choose_the_kernels_where_pallas_runs():
    """The jnp form and the reference on the CPU; the kernels where Pallas runs (interpret mode here;
    the model test below runs them through the ops), except for calls they refuse."""
    args = _packed(SHORT, pad=3, heads=2, dk=16, dv=32)
    pool_args = _pool_case()
    small = _packed([5], pad=0, dk=8, dv=8)  # Dk 8: too small for the kernel's matmuls
    prefill, decode = lightning.lightning_attention_op, lightning.recurrent_update_op
    cpu, interpreted = registry.Target(platform="cpu"), registry.Target.interpreted()
    assert prefill.choose(cpu, *args).name == "chunked" and decode.choose(cpu, *pool_args).name == "reference"
    assert prefill.choose(interpreted, *args).name == "triton"
    assert decode.choose(interpreted, *pool_args).name == "triton"
    assert prefill.choose(interpreted, *small).name == "chunked"
    bf16_pool = (pool_args[0].astype(jnp.bfloat16), *pool_args[1:])
    assert decode.choose(interpreted, *bf16_pool).name == "reference"


def test_the_kernels_refuse_what_they_do_not_take():
    q, k, v, slope, cu, state = _packed([5, 9], pad=0, heads=2, dk=16, dv=16)
    assert chunked_pallas.supports(q, k, v, slope, cu, state)
    assert not chunked_pallas.supports(q[..., :12], k[..., :12], v, slope, cu, state[:, :, :12])  # Dk 12
    assert not chunked_pallas.supports(q, k, v.astype(jnp.bfloat16), slope, cu, state)  # mixed dtypes
    assert not chunked_pallas.supports(q, k, v, slope[:1], cu, state)
    assert not chunked_pallas.supports(q, k, v, slope, cu, state, block_v=32)  # wider than Dv
    assert not chunked_pallas.supports(q, k, v, slope, cu, state, chunk=8)
    assert not chunked_pallas.supports(q, k, v, slope, cu, state, unroll=2)
    pool, slots, q, k, v, slope = _pool_case()
    assert recurrent_pallas.supports(pool, slots, q, k, v, slope)
    assert not recurrent_pallas.supports(pool.astype(jnp.bfloat16), slots, q, k, v, slope)
    assert not recurrent_pallas.supports(pool, slots[:2], q, k, v, slope)
    assert not recurrent_pallas.supports(pool[..., :24], slots, q, k, v[..., :24], slope)  # Dv 24
    with pytest.raises(ValueError, match="head dims"):
        recurrent_pallas.recurrent_update(pool[..., :24], slots, q, k, v[..., :24], slope, interpret=True)


def _lower_for_gpu(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("dtype, head_dim", [(jnp.bfloat16, 128), (jnp.float32, 64)])
def test_the_kernels_lower_for_the_gpu(dtype, head_dim):
    """MiniMax-Text-01's shape (64 heads of 128) and a float32 one: a 4-sequence prefill of 4096
    tokens and a 32-row decode step over a 64-slot pool."""
    t, heads, seqs, d = 4096, 64, 4, head_dim
    text = _lower_for_gpu(chunked_pallas.lightning_attention, S((t, heads, d), dtype), S((t, heads, d), dtype),
                          S((t, heads, d), dtype), S((heads,), jnp.float32), S((seqs + 1,), jnp.int32),
                          S((seqs, heads, d, d), jnp.float32))
    assert "lightning_prefill" in text
    text = _lower_for_gpu(recurrent_pallas.recurrent_update, S((64, heads, d, d), jnp.float32), S((32,), jnp.int32),
                          S((32, heads, d), dtype), S((32, heads, d), dtype), S((32, heads, d), dtype),
                          S((heads,), jnp.float32))
    assert "lightning_decode" in text


def _rms_norm(x, weight, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


@pytest.mark.parametrize("target", ["cpu", "interpreted"])
def test_the_ops_reproduce_transformers_lightning_attention(target):
    """HF's layer 1 of 4 (block_size 256) on 300 tokens (two blocks, the second partial), then three
    decode steps through its cache; ours: the projections, SiLU, the op, RMSNorm over H * D (eps
    1e-6), the output gate and out_proj, with the slope from the global layer index. The attention
    core (the norm's input), the outputs and the cached state all match. ``interpreted``: served by
    the Pallas kernels in interpret mode."""
    from transformers import MiniMaxConfig
    from transformers.models.minimax.modeling_minimax import MiniMaxCache, MiniMaxLightningAttention

    heads, head_dim, hidden, layers, layer_idx, t, steps = 4, 16, 48, 4, 1, 300, 3
    config = MiniMaxConfig(hidden_size=hidden, num_attention_heads=heads, head_dim=head_dim,
                           num_hidden_layers=layers, num_key_value_heads=2, intermediate_size=32)
    assert config.block_size == 256 and config.layer_types[layer_idx] == "linear_attention"
    torch.manual_seed(0)
    attn = MiniMaxLightningAttention(config, layer_idx).float().eval()
    with torch.no_grad():
        for p in (attn.qkv_proj.weight, attn.output_gate.weight, attn.out_proj.weight):
            p.normal_(0.0, hidden ** -0.5)
        attn.norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(1, t + steps, hidden)
    cores = []
    hook = attn.norm.register_forward_hook(lambda module, args, out: cores.append(args[0][0].numpy().copy()))
    cache = MiniMaxCache()
    with torch.no_grad():
        want = [attn(x[:, :t], None, None, cache=cache)[0][0].numpy()]
        for i in range(t, t + steps):
            want.append(attn(x[:, i:i + 1], None, None, cache=cache)[0][0].numpy())
    hook.remove()
    want_state = cache.linear_cache[layer_idx][0].numpy()

    base = 2.0 ** (-8.0 / heads)
    slope = base ** np.arange(1, heads + 1) * (1 - layer_idx / (layers - 1 + 1e-5) + 1e-5)
    np.testing.assert_allclose(slope, attn.slope_rate.flatten().numpy(), rtol=1e-6)
    slope = jnp.asarray(slope, jnp.float32)
    w_qkv, w_gate, w_out = (m.weight.detach().numpy() for m in (attn.qkv_proj, attn.output_gate, attn.out_proj))
    norm_weight = attn.norm.weight.detach().numpy()
    x = x[0].numpy()

    def qkv(rows):
        packed = _silu(rows @ w_qkv.T).reshape(len(rows), heads, 3 * head_dim)  # per head [q | k | v]
        return tuple(jnp.asarray(packed[..., i * head_dim:(i + 1) * head_dim]) for i in range(3))

    def finish(rows, core):
        core = np.asarray(core).reshape(len(rows), heads * head_dim)
        gate = 1 / (1 + np.exp(-(rows @ w_gate.T)))
        return core, (_rms_norm(core, norm_weight) * gate) @ w_out.T

    chosen_target = registry.Target.interpreted() if target == "interpreted" else registry.Target(platform="cpu")
    with registry.targeting(chosen_target), registry.recording() as chosen:
        core, state = _traced(lightning.lightning_attention)(
            *qkv(x[:t]), slope, jnp.asarray([0, t], jnp.int32), jnp.zeros((1, heads, head_dim, head_dim), jnp.float32))
        results = [finish(x[:t], core)]
        pool = jnp.zeros((3, heads, head_dim, head_dim), jnp.float32).at[2].set(state[0])
        decode = _traced(lightning.recurrent_update)
        for i in range(t, t + steps):
            out, pool = decode(pool, jnp.asarray([2], jnp.int32), *qkv(x[i:i + 1]), slope)
            results.append(finish(x[i:i + 1], out))
    kernel = "triton" if target == "interpreted" else None
    assert chosen == {"lightning.lightning_attention": {kernel or "chunked"},
                      "lightning.recurrent_update": {kernel or "reference"}}
    assert np.abs(want[0]).max() > 0.1 and np.abs(want_state).max() > 1.0  # not vanishing: a real comparison
    assert len(results) == len(cores) == len(want) == 1 + steps
    for (got_core, got), want_core, want_out in zip(results, cores, want):
        np.testing.assert_allclose(got_core, want_core, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got, want_out, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(pool[2]), want_state, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(pool[:2]), 0.0)
