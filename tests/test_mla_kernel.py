"""MLA (multi-head latent attention) over the paged latent cache: the absorbed-form reference against
a dense formulation with explicit per-head keys and values, the paging and chunking against
contiguous keys, and the Pallas decode kernel (interpret mode, CPU) against the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.kernels import mla, registry
from jaxinfer.kernels.mla import decode_pallas, reference

# Jitted once for the whole file: op-by-op the references dispatch dozens of small computations.
write_latent_cache = jax.jit(reference.write_latent_cache)
decode_reference = jax.jit(reference.mla_paged_decode_attention, static_argnames="scale")
ragged_reference = jax.jit(reference.mla_ragged_paged_attention, static_argnames="scale")


def _dense_attention(q, k, v, visible):
    """float64 softmax attention of one head: q [Tq, d], k [Tk, d], v [Tk, dv], visible [Tq, Tk]."""
    scores = np.where(visible, q @ k.T, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v


def _paged_cache(rng, lengths, page_size, latent_dim, rope_dim, dtype, spare_pages=3, stale=None):
    """Each sequence's random [latent | k_rope] rows written through ``write_latent_cache`` into
    shuffled pages -> (cache, block_tables, per-sequence rows [L_s, R + P] as float64). The other
    rows hold random values, or ``stale`` where given."""
    pages_per_seq = max(-(-n // page_size) for n in lengths) + 1
    num_pages = len(lengths) * pages_per_seq + spare_pages
    tables = rng.permutation(num_pages)[: len(lengths) * pages_per_seq].reshape(len(lengths), pages_per_seq)
    cache = rng.randn(num_pages, page_size, latent_dim + rope_dim)
    cache = jnp.asarray(cache if stale is None else np.full_like(cache, stale), dtype)
    rows, slots = [], []
    for s, n in enumerate(lengths):
        rows.append(rng.randn(n, latent_dim + rope_dim))
        slots += [tables[s, j // page_size] * page_size + j % page_size for j in range(n)]
    flat = np.concatenate(rows)
    cache = write_latent_cache(cache, jnp.asarray(flat[:, :latent_dim], jnp.float32),
                               jnp.asarray(flat[:, latent_dim:], jnp.float32), jnp.asarray(slots, jnp.int32))
    cast = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)  # noqa: E731
    return cache, jnp.asarray(tables, jnp.int32), [cast(r) for r in rows]


def test_absorbed_reference_equals_dense_mla():
    """Per-head keys [latent W_UK_h ; k_rope] and values latent W_UV_h, softmax(q.K) V, equal the
    absorbed form (q_latent = W_UK_h q_nope over the latent cache) followed by W_UV, in prefill and decode."""
    rng = np.random.RandomState(0)
    tokens, heads, latent_dim, rope_dim, nope_dim, v_dim, page_size = 9, 3, 16, 8, 12, 10, 4
    scale = (nope_dim + rope_dim) ** -0.5
    latent, k_rope = rng.randn(tokens, latent_dim), rng.randn(tokens, rope_dim)
    q_nope, q_rope = rng.randn(tokens, heads, nope_dim), rng.randn(tokens, heads, rope_dim)
    w_uk, w_uv = rng.randn(heads, latent_dim, nope_dim) * 0.3, rng.randn(heads, latent_dim, v_dim)

    causal = np.tril(np.ones((tokens, tokens), bool))
    dense = np.stack([
        _dense_attention(np.concatenate([q_nope[:, h], q_rope[:, h]], -1) * scale,
                         np.concatenate([latent @ w_uk[h], k_rope], -1), latent @ w_uv[h], causal)
        for h in range(heads)], axis=1)  # [T, H, v_dim]

    cache = write_latent_cache(jnp.zeros((4, page_size, latent_dim + rope_dim), jnp.float32),
                               jnp.asarray(latent, jnp.float32), jnp.asarray(k_rope, jnp.float32),
                               jnp.arange(tokens, dtype=jnp.int32))
    table = jnp.arange(4, dtype=jnp.int32)[None]
    q_latent = jnp.asarray(np.einsum("thn,hrn->thr", q_nope, w_uk), jnp.float32)
    q_rope32 = jnp.asarray(q_rope, jnp.float32)
    prefill = ragged_reference(q_latent, q_rope32, cache, jnp.arange(tokens, dtype=jnp.int32),
                               jnp.zeros(tokens, jnp.int32), table, jnp.asarray([tokens], jnp.int32), scale=scale)
    decode = decode_reference(q_latent[-1:], q_rope32[-1:], cache, table, jnp.asarray([tokens], jnp.int32),
                              scale=scale)
    for out, expected in ((prefill, dense), (decode, dense[-1:])):
        absorbed = np.einsum("thr,hrv->thv", np.asarray(out, np.float64), w_uv)
        np.testing.assert_allclose(absorbed, expected, rtol=1e-5, atol=1e-5)


def _contiguous_attention(q_latent, q_rope, rows, query_pos, scale):
    """float64 attention of one query [H, R] / [H, P] over contiguous rows [L, R + P] up to query_pos."""
    latent_dim = q_latent.shape[-1]
    keys = rows[: query_pos + 1]
    q = np.concatenate([q_latent, q_rope], -1).astype(np.float64) * scale
    return _dense_attention(q, keys, keys[:, :latent_dim], np.ones((q.shape[0], len(keys)), bool))


def test_paged_cache_equals_contiguous_keys():
    rng = np.random.RandomState(1)
    lengths, heads, latent_dim, rope_dim, page_size, scale = [5, 13, 1], 2, 16, 8, 4, 0.3
    cache, tables, rows = _paged_cache(rng, lengths, page_size, latent_dim, rope_dim, jnp.float32)
    seq_lens = jnp.asarray(lengths, jnp.int32)
    q_latent = rng.randn(len(lengths), heads, latent_dim)
    q_rope = rng.randn(len(lengths), heads, rope_dim)
    out = decode_reference(jnp.asarray(q_latent, jnp.float32), jnp.asarray(q_rope, jnp.float32), cache, tables,
                           seq_lens, scale=scale)
    for s, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(out[s]), _contiguous_attention(q_latent[s], q_rope[s], rows[s], n - 1,
                                                                              scale), rtol=1e-5, atol=1e-5)

    # Ragged: every token of every sequence, interleaved across sequences.
    token_seq = np.concatenate([[s] * n for s, n in enumerate(lengths)])
    token_pos = np.concatenate([np.arange(n) for n in lengths])
    order = rng.permutation(len(token_seq))
    token_seq, token_pos = token_seq[order], token_pos[order]
    tq_latent = rng.randn(len(order), heads, latent_dim)
    tq_rope = rng.randn(len(order), heads, rope_dim)
    ragged = ragged_reference(
        jnp.asarray(tq_latent, jnp.float32), jnp.asarray(tq_rope, jnp.float32), cache,
        jnp.asarray(token_pos, jnp.int32), jnp.asarray(token_seq, jnp.int32), tables, seq_lens, scale=scale)
    for t in range(len(order)):
        expected = _contiguous_attention(tq_latent[t], tq_rope[t], rows[token_seq[t]], token_pos[t], scale)
        np.testing.assert_allclose(np.asarray(ragged[t]), expected, rtol=1e-5, atol=1e-5)


def test_write_latent_cache_drops_padding_and_casts():
    cache = jnp.zeros((2, 4, 6), jnp.bfloat16)
    latent = jnp.arange(12, dtype=jnp.float32).reshape(3, 4) + 0.1
    k_rope = -jnp.arange(6, dtype=jnp.float32).reshape(3, 2)
    out = write_latent_cache(cache, latent, k_rope, jnp.asarray([5, -1, 0], jnp.int32))
    assert out.dtype == jnp.bfloat16 and out.shape == cache.shape
    rows = np.asarray(out.reshape(8, 6), np.float32)
    expected = np.asarray(jnp.concatenate([latent, k_rope], -1).astype(jnp.bfloat16), np.float32)
    np.testing.assert_array_equal(rows[5], expected[0])
    np.testing.assert_array_equal(rows[0], expected[2])
    assert not rows[[1, 2, 3, 4, 6, 7]].any()  # the padding token (slot -1) wrote nothing
    with pytest.raises(ValueError, match="cache row width"):
        write_latent_cache(cache, latent[:, :3], k_rope, jnp.zeros(3, jnp.int32))


def test_chunked_prefill_equals_one_shot():
    rng = np.random.RandomState(2)
    length, split, heads, latent_dim, rope_dim, page_size, scale = 11, 6, 2, 16, 8, 4, 0.25
    latent = jnp.asarray(rng.randn(length, latent_dim), jnp.float32)
    k_rope = jnp.asarray(rng.randn(length, rope_dim), jnp.float32)
    q_latent = jnp.asarray(rng.randn(length, heads, latent_dim), jnp.float32)
    q_rope = jnp.asarray(rng.randn(length, heads, rope_dim), jnp.float32)
    table = jnp.asarray([[3, 0, 2, 5]], jnp.int32)
    slots = (table[0, jnp.arange(length) // page_size] * page_size + jnp.arange(length) % page_size).astype(jnp.int32)
    empty = jnp.zeros((6, page_size, latent_dim + rope_dim), jnp.float32)
    positions = jnp.arange(length, dtype=jnp.int32)
    seq_ids = jnp.zeros(length, jnp.int32)

    def step(cache, chunk, seq_len):
        cache = write_latent_cache(cache, latent[chunk], k_rope[chunk], slots[chunk])
        out = ragged_reference(q_latent[chunk], q_rope[chunk], cache, positions[chunk], seq_ids[chunk], table,
                               jnp.asarray([seq_len], jnp.int32), scale=scale)
        return cache, out

    cache, first = step(empty, slice(0, split), split)
    _, second = step(cache, slice(split, length), length)
    _, whole = step(empty, slice(0, length), length)
    np.testing.assert_allclose(np.concatenate([first, second]), np.asarray(whole), rtol=1e-6, atol=1e-6)


def test_padding_rows_and_invalid_tokens_give_zeros():
    # Every row no sequence owns is NaN: what lies past a sequence's length never reaches an output.
    rng = np.random.RandomState(3)
    cache, tables, _ = _paged_cache(rng, [6, 3], 4, 16, 16, jnp.float32, stale=np.nan)
    q_latent = jnp.asarray(rng.randn(2, 2, 16), jnp.float32)
    q_rope = jnp.asarray(rng.randn(2, 2, 16), jnp.float32)
    seq_lens = jnp.asarray([6, 0], jnp.int32)
    out = decode_reference(q_latent, q_rope, cache, tables, seq_lens, scale=0.2)
    assert np.isfinite(np.asarray(out)).all() and not np.asarray(out[1]).any() and np.asarray(out[0]).any()
    from_kernel = decode_pallas.mla_paged_decode_attention(q_latent, q_rope, cache, tables, seq_lens, scale=0.2,
                                                           interpret=True)
    np.testing.assert_allclose(np.asarray(from_kernel), np.asarray(out), rtol=1e-5, atol=1e-5)

    seq_lens = jnp.asarray([6, 3], jnp.int32)
    positions = jnp.asarray([5, 2, 0, 1], jnp.int32)
    seq_ids = jnp.asarray([0, 1, 0, -1], jnp.int32)  # the last token belongs to no sequence
    valid = jnp.asarray([True, False, True, True])
    q4 = jnp.concatenate([q_latent, q_latent]), jnp.concatenate([q_rope, q_rope])
    ragged = ragged_reference(*q4, cache, positions, seq_ids, tables, seq_lens, scale=0.2, valid=valid)
    unmasked = ragged_reference(*q4, cache, positions, seq_ids, tables, seq_lens, scale=0.2)
    ragged, unmasked = np.asarray(ragged), np.asarray(unmasked)
    assert np.isfinite(ragged).all() and not ragged[[1, 3]].any()
    np.testing.assert_array_equal(ragged[[0, 2]], unmasked[[0, 2]])
    np.testing.assert_allclose(ragged[0], np.asarray(out[0]), rtol=1e-6, atol=1e-6)  # = the decode row


# The Pallas kernel in interpret mode against the reference.

def _kernel_case(num_seqs, heads, latent_dim, rope_dim, page_size, lengths, dtype, seed=0):
    rng = np.random.RandomState(seed)
    pages_per_seq = -(-max(lengths) // page_size) + 1
    num_pages = num_seqs * pages_per_seq + 2
    tables = rng.permutation(num_pages)[: num_seqs * pages_per_seq].reshape(num_seqs, pages_per_seq)
    cast = lambda *shape: jnp.asarray(rng.randn(*shape), dtype)  # noqa: E731
    return (cast(num_seqs, heads, latent_dim), cast(num_seqs, heads, rope_dim),
            cast(num_pages, page_size, latent_dim + rope_dim), jnp.asarray(tables, jnp.int32),
            jnp.asarray(lengths, jnp.int32))


def _float32_reference(q_latent, q_rope, cache, tables, seq_lens, scale):
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return decode_reference(f32(q_latent), f32(q_rope), f32(cache), tables, seq_lens, scale=scale)


# heads, R, P, page size, lengths (ragged, a padding row, lengths past whole pages), tuning.
_CASES = {
    "one-split-one-block": (4, 32, 16, 4, [0, 1, 7, 21], {}),
    "one-split-loop": (4, 32, 16, 4, [0, 1, 7, 21], {"block_keys": 16, "num_splits": 1}),
    "splits-loop": (8, 64, 32, 8, [0, 19, 45, 3], {"block_keys": 16, "num_splits": 2}),
    "splits-one-block-each": (16, 64, 16, 16, [31, 0, 5], {"block_keys": 16, "num_splits": 3}),  # 3 of 4 slots
    "padded-heads": (12, 128, 32, 16, [0, 40, 17], {"block_keys": 32}),
    "two-head-blocks": (32, 32, 16, 4, [10, 0, 23], {"block_heads": 16, "block_keys": 16, "num_splits": 2}),
}


@pytest.mark.parametrize("name", sorted(_CASES))
def test_kernel_matches_reference_float32(name):
    heads, latent_dim, rope_dim, page_size, lengths, tuning = _CASES[name]
    args = _kernel_case(len(lengths), heads, latent_dim, rope_dim, page_size, lengths, jnp.float32)
    out = decode_pallas.mla_paged_decode_attention(*args, scale=0.15, interpret=True, **tuning)
    expected = decode_reference(*args, scale=0.15)
    assert out.shape == expected.shape and out.dtype == jnp.float32
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-5)
    assert not np.asarray(out)[np.asarray(lengths) == 0].any()


@pytest.mark.parametrize("name", ["splits-loop", "padded-heads"])
def test_kernel_matches_reference_bfloat16(name):
    # The kernel rounds the probabilities to bf16 for the value matmul and its output to bf16;
    # against the float32 reference of the same bf16 inputs that is within one bf16 ulp of outputs
    # up to ~2.7 (2**-6 at 2).
    heads, latent_dim, rope_dim, page_size, lengths, tuning = _CASES[name]
    args = _kernel_case(len(lengths), heads, latent_dim, rope_dim, page_size, lengths, jnp.bfloat16, seed=5)
    out = decode_pallas.mla_paged_decode_attention(*args, scale=0.15, interpret=True, **tuning)
    assert out.dtype == jnp.bfloat16
    expected = _float32_reference(*args, scale=0.15)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected), rtol=2**-7, atol=2**-6)


def test_plan_blocking_at_deepseek_v3_shape():
    # H 128, R 512, P 64, bf16, pages of 64: 32 heads per program, 64-key blocks, within both budgets.
    one = decode_pallas.plan_blocking(1, 128, 4096, 512, 64, 2)
    many = decode_pallas.plan_blocking(128, 128, 2048, 512, 64, 2)
    assert (one.block_heads, one.block_keys, one.num_warps) == (32, 64, 4) and one.num_splits == 32
    assert many.num_splits == 1
    for plan, itemsize in ((one, 2), (decode_pallas.plan_blocking(4, 128, 4096, 512, 64, 4), 4)):
        assert decode_pallas._accumulator_bytes(plan.block_heads, 512) <= (
            plan.num_warps * decode_pallas._ACCUMULATOR_BYTES_PER_WARP)
        assert decode_pallas._shared_bytes(plan.block_heads, plan.block_keys, 512, 64, itemsize,
                                           plan.num_stages) <= decode_pallas._SHARED_BYTES
    assert decode_pallas.plan_blocking(2, 4, 10, 32, 16, 4).block_keys == 16  # never past the block table


def _shape(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("q_latent, q_rope, cache, options", [
    (_shape(2, 8, 48), _shape(2, 8, 16), _shape(4, 16, 64), {}),  # R not a power of two
    (_shape(2, 8, 64), _shape(2, 8, 8), _shape(4, 16, 72), {}),  # P below a tensor-core K
    (_shape(2, 8, 64), _shape(2, 8, 16), _shape(4, 16, 80, dtype=jnp.float32), {}),  # mixed dtypes
    (_shape(2, 8, 64, dtype=jnp.int8), _shape(2, 8, 16, dtype=jnp.int8), _shape(4, 16, 80, dtype=jnp.int8), {}),
    (_shape(2, 8, 64), _shape(2, 8, 16), _shape(4, 16, 96), {}),  # R + P is not the row width
    (_shape(2, 8, 64), _shape(2, 8, 16), _shape(4, 16, 80), {"block_heads": 8}),
    (_shape(2, 8, 64), _shape(2, 8, 16), _shape(4, 16, 80), {"sliding_window": 8}),
    (_shape(2, 128, 4096), _shape(2, 128, 64), _shape(4, 16, 4160), {}),  # no 16-head accumulator fits
    (_shape(1, 16, 512), _shape(1, 16, 64), _shape(4, 64, 576), {"block_keys": 256}),  # shared memory
    (_shape(1, 16, 512), _shape(1, 16, 64), _shape(2**16, 64, 576), {}),  # past 32-bit element offsets
])
def test_supports_refuses_what_the_kernel_cannot_take(q_latent, q_rope, cache, options):
    assert not decode_pallas.supports(q_latent, q_rope, cache, **options)
    assert decode_pallas.supports(_shape(2, 8, 64), _shape(2, 8, 16), _shape(4, 16, 80))


def test_dispatch_takes_the_kernel_only_where_supported():
    op = mla.mla_paged_decode_attention_op
    gpu = registry.Target(platform="gpu", compute_capability="9.0", sm_count=132)
    for latent_dim, dtype, target, expected in [
        (32, jnp.bfloat16, gpu, "triton"),
        (32, jnp.float32, gpu, "reference"),  # XLA's fusion was faster in float32
        (48, jnp.bfloat16, gpu, "reference"),  # refused: R not a power of two
        (32, jnp.float32, registry.Target.interpreted(), "triton"),
        (32, jnp.bfloat16, registry.current_target(), "reference"),  # the CPU
    ]:
        args = _kernel_case(3, 4, latent_dim, 16, 4, [0, 9, 14], dtype, seed=7)
        assert op.choose(target, *args, scale=0.2).name == expected, (latent_dim, dtype, target)
    args = _kernel_case(3, 4, 32, 16, 4, [0, 9, 14], jnp.float32, seed=7)
    with registry.targeting(registry.Target.interpreted()), registry.recording() as chosen:
        out = mla.mla_paged_decode_attention(*args, scale=0.2)
    assert chosen == {"mla.mla_paged_decode_attention": {"triton"}}
    np.testing.assert_allclose(np.asarray(out), np.asarray(decode_reference(*args, scale=0.2)), rtol=1e-5, atol=1e-5)
    kernel = decode_pallas.mla_paged_decode_attention
    with pytest.raises(ValueError, match="R=48 must be a power of two"):
        kernel(*_kernel_case(1, 4, 48, 16, 4, [3], jnp.float32), scale=0.2, interpret=True)
