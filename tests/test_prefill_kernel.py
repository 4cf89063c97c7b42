"""The Pallas ragged paged prefill kernel (interpret mode, CPU) against the plain-jnp reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.cache.metadata import StepMetadata
from jaxinfer.kernels.attention import prefill_pallas, reference


def make_step(seqs, *, heads, kv_heads, head_dim, page_size, dtype, num_pad_tokens=3, num_pad_seqs=1,
              spare_pages=2, seed=0):
    """A packed step: ``seqs`` = [(cached, new), ...]; random cache pages, shuffled block tables.

    Sequence ``s`` already holds ``cached`` tokens and brings ``new`` more at positions
    ``cached .. cached + new - 1``. Padding tokens (slot -1, sequence 0, position 0) follow the real
    ones; padding sequences (seq_len 0, block table of zeros) follow the real ones.
    """
    rng = np.random.RandomState(seed)
    pages_needed = [-(-(c + n) // page_size) for c, n in seqs]
    pages_per_seq = max(pages_needed) + spare_pages
    num_pages = sum(pages_needed) + 5
    perm = rng.permutation(num_pages)
    block_tables = np.zeros((len(seqs) + num_pad_seqs, pages_per_seq), np.int32)
    positions, seq_ids, slots = [], [], []
    used = 0
    for s, ((cached, new), n_pages) in enumerate(zip(seqs, pages_needed)):
        block_tables[s, :n_pages] = perm[used:used + n_pages]
        used += n_pages
        for p in range(cached, cached + new):
            positions.append(p)
            seq_ids.append(s)
            slots.append(block_tables[s, p // page_size] * page_size + p % page_size)
    num_real = len(positions)
    positions += [0] * num_pad_tokens
    seq_ids += [-1] * num_pad_tokens  # padding belongs to no sequence
    slots += [-1] * num_pad_tokens
    seq_lens = np.array([c + n for c, n in seqs] + [0] * num_pad_seqs, np.int32)
    md = StepMetadata(
        positions=jnp.array(positions, jnp.int32), slot_mapping=jnp.array(slots, jnp.int32),
        token_seq_ids=jnp.array(seq_ids, jnp.int32), block_tables=jnp.array(block_tables),
        seq_lens=jnp.array(seq_lens), logits_indices=jnp.zeros(len(seq_lens), jnp.int32))
    t = len(positions)
    q = jnp.array(rng.randn(t, heads, head_dim), dtype)
    k_cache = jnp.array(rng.randn(kv_heads, num_pages, page_size, head_dim), dtype)
    v_cache = jnp.array(rng.randn(kv_heads, num_pages, page_size, head_dim), dtype)
    return q, k_cache, v_cache, md, num_real


def ragged(md):
    """The ragged attention op's named arrays."""
    return md.positions, md.token_seq_ids, md.block_tables, md.seq_lens


RAGGED = [(0, 37), (21, 5), (40, 1), (3, 20)]  # fresh prompt, chunked prefill, decode-like, short prefix
CASES = {
    # name: (seqs, heads, kv_heads, head_dim, page_size, dtype, options, block sizes)
    "gqa-d64-p16-f32": (RAGGED, 8, 2, 64, 16, jnp.float32, {}, {}),
    "gqa-d64-p16-f32-window-sinks-softcap": (RAGGED, 8, 2, 64, 16, jnp.float32,
                                             dict(sliding_window=12, sinks=True, logit_softcap=2.0), {}),
    "gqa-d128-p32-bf16": ([(0, 19), (45, 30), (7, 2)], 8, 2, 128, 32, jnp.bfloat16, {}, {}),
    "gqa-d128-p32-bf16-window-sinks-softcap": ([(0, 19), (45, 30), (7, 2)], 8, 2, 128, 32, jnp.bfloat16,
                                               dict(sliding_window=24, sinks=True, logit_softcap=2.0), {}),
    "mqa-d64-p32-f32-window": ([(5, 41), (0, 3), (33, 17)], 4, 1, 64, 32, jnp.float32,
                               dict(sliding_window=20), {}),
    "mqa-d128-p16-bf16-sinks": ([(0, 23), (70, 9)], 4, 1, 128, 16, jnp.bfloat16, dict(sinks=True), {}),
    "group3-d64-p16-f32-softcap-sinks": (RAGGED, 6, 2, 64, 16, jnp.float32,
                                         dict(logit_softcap=2.0, sinks=True), {}),
    "mha-d64-p32-bf16-window": ([(9, 30), (1, 12)], 2, 2, 64, 32, jnp.bfloat16, dict(sliding_window=7), {}),
    # Tiny blocks: many query blocks per sequence, and leading-masked / unmasked / trailing-masked
    # key blocks all in use.
    "small-blocks-f32-window": ([(50, 37), (80, 6), (0, 19)], 8, 2, 64, 16, jnp.float32,
                                dict(sliding_window=40), dict(block_q=4, pages_per_block=1)),
    "small-blocks-f32": ([(50, 37), (80, 6), (0, 19)], 16, 1, 64, 16, jnp.float32, {},
                         dict(block_q=1, pages_per_block=1)),
    "decode-only-f32": ([(12, 1), (40, 1), (0, 1), (77, 1)], 8, 2, 64, 16, jnp.float32,
                        dict(sliding_window=16), {}),
    # Pages larger than a key block: read as virtual pages (d256 -> block_k 32 by default).
    "gqa-d256-p64-bf16-split": ([(70, 30), (0, 9)], 4, 2, 256, 64, jnp.bfloat16, dict(sinks=True), {}),
    "gqa-d64-p128-f32-split-window": ([(100, 45), (0, 30)], 4, 2, 64, 128, jnp.float32,
                                      dict(sliding_window=50), dict(block_k=16)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
    seqs, heads, kv_heads, head_dim, page_size, dtype, options, blocks = CASES[name]
    q, k_cache, v_cache, md, num_real = make_step(seqs, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                                  page_size=page_size, dtype=dtype)
    options = dict(options)
    if options.pop("sinks", False):
        options["sinks"] = jnp.array(np.random.RandomState(1).randn(heads) * 2.0, jnp.float32)
    scale = head_dim ** -0.5
    want = reference.ragged_paged_attention(q, k_cache, v_cache, *ragged(md), scale=scale, **options)
    got = prefill_pallas.ragged_paged_attention(q, k_cache, v_cache, *ragged(md), scale=scale, interpret=True,
                                                **options, **blocks)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert bool(jnp.isfinite(got.astype(jnp.float32)).all()), "NaN/inf in the output (padding included)"
    np.testing.assert_array_equal(np.asarray(got[num_real:], np.float32), 0.0)  # padding tokens give zeros
    atol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got[:num_real], np.float32), np.asarray(want[:num_real], np.float32),
                               atol=atol, rtol=atol)


def test_options_change_the_output():
    """Sanity of the comparisons above: window, sinks and softcap each change the result."""
    q, k_cache, v_cache, md, num_real = make_step(RAGGED, heads=8, kv_heads=2, head_dim=64, page_size=16,
                                                  dtype=jnp.float32)
    run = lambda **o: np.asarray(prefill_pallas.ragged_paged_attention(
        q, k_cache, v_cache, *ragged(md), scale=0.125, interpret=True, **o)[:num_real])
    base = run()
    np.testing.assert_allclose(base, np.asarray(reference.ragged_paged_attention(
        q, k_cache, v_cache, *ragged(md), scale=0.125)[:num_real]), atol=1e-5)
    for options in (dict(sliding_window=12), dict(sinks=jnp.full((8,), 3.0)), dict(logit_softcap=1.0)):
        assert np.abs(run(**options) - base).max() > 1e-2, options


def _visible(p, j, seq_len, window):
    return (j <= p) & (j < seq_len) & ((j > p - window) if window else True)


@pytest.mark.parametrize("window", [None, 13, 40])
@pytest.mark.parametrize("block_q,page_size,pages_per_block", [(4, 16, 1), (8, 8, 2), (16, 16, 4)])
def test_query_blocks(window, block_q, page_size, pages_per_block):
    """The ragged blocking: every real token in exactly one (block, row), one sequence per block, and
    the per-block key ranges cover everything visible, the unmasked ones only keys every row sees."""
    seqs = [(50, 37), (80, 6), (0, 19), (7, 1), (0, 64)]
    _, _, _, md, num_real = make_step(seqs, heads=1, kv_heads=1, head_dim=16, page_size=page_size,
                                      dtype=jnp.float32, num_pad_tokens=5, num_pad_seqs=2)
    t, num_seqs = md.positions.shape[0], md.seq_lens.shape[0]
    pages_per_seq = md.block_tables.shape[1]
    block_k = page_size * pages_per_block
    num_blocks = min(t, -(-t // block_q) + num_seqs)
    meta, row_pos, row_tok, row_valid = map(np.asarray, prefill_pallas.query_blocks(
        md.positions, md.token_seq_ids, md.seq_lens, md.token_seq_ids >= 0, block_q=block_q, num_blocks=num_blocks, page_size=page_size, block_k=block_k,
        pages_per_seq=pages_per_seq, sliding_window=window))
    positions, seq_ids = np.asarray(md.positions), np.asarray(md.token_seq_ids)
    seq_lens = np.asarray(md.seq_lens)

    # Every real token is the valid row of exactly one block (the kernel reads its query and writes
    # its output there); padding tokens are in none.
    assert sorted(row_tok[row_valid].tolist()) == list(range(num_real))
    assert sum(-(-n // block_q) for _, n in seqs) == int((row_valid.sum(1) > 0).sum())
    np.testing.assert_array_equal(row_pos[row_valid], positions[row_tok[row_valid]])
    for b in range(num_blocks):
        seq, first_page, k_a, k_b, num_kb, kv_end = meta[b, :6]
        rows = np.nonzero(row_valid[b])[0]
        if rows.size == 0:
            assert num_kb == 0
            continue
        assert (seq_ids[row_tok[b, rows]] == seq).all()
        assert 0 <= k_a <= k_b <= num_kb
        lo = first_page * page_size
        assert first_page + num_kb * pages_per_block <= pages_per_seq + pages_per_block  # padded table
        keys = np.arange(pages_per_seq * page_size)
        covered = (keys >= lo) & (keys < min(lo + num_kb * block_k, kv_end))
        unmasked = (keys >= lo + k_a * block_k) & (keys < lo + k_b * block_k)
        for r in rows:
            vis = _visible(row_pos[b, r], keys, seq_lens[seq], window)
            assert not (vis & ~covered).any(), "a visible key outside the block's key range"
            assert vis[unmasked].all(), "an unmasked key block hides a key from some row"
        if window is None and rows.size > 1:  # long enough prefixes do use the unmasked loop
            assert k_b > 0 or row_pos[b, rows].min() + 1 < block_k


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_default_block_sizes(head_dim, group, dtype):
    for num_tokens in (1, 7, 300, 8192):
        b = prefill_pallas.default_block_sizes(num_tokens, group, head_dim, dtype)
        rows = b["block_q"] * prefill_pallas._next_pow2(group)
        block_k = b["block_k"]
        for n in (b["block_q"], rows, block_k):
            assert prefill_pallas._is_pow2(n)
        assert rows >= 16 and block_k >= 16
        assert b["num_warps"] in (4, 8) and 1 <= b["num_stages"] <= 3
        item = jnp.dtype(dtype).itemsize
        assert (2 * block_k * b["num_stages"] + rows) * head_dim * item <= 228 * 1024  # Hopper shared memory


def test_rejects_bad_block_sizes():
    q, k_cache, v_cache, md, _ = make_step([(0, 5)], heads=2, kv_heads=2, head_dim=64, page_size=16,
                                           dtype=jnp.float32)
    with pytest.raises(ValueError, match="block_q"):
        prefill_pallas.ragged_paged_attention(q, k_cache, v_cache, *ragged(md), scale=1.0, interpret=True, block_q=8)
    with pytest.raises(ValueError, match="block_q"):
        prefill_pallas.ragged_paged_attention(q, k_cache, v_cache, *ragged(md), scale=1.0, interpret=True, block_q=24)
    with pytest.raises(ValueError, match="block_k"):
        prefill_pallas.ragged_paged_attention(q, k_cache, v_cache, *ragged(md), scale=1.0, interpret=True, block_k=8)
    with pytest.raises(ValueError, match="pages_per_block"):
        prefill_pallas.ragged_paged_attention(q, k_cache, v_cache, *ragged(md), scale=1.0, interpret=True,
                                              pages_per_block=3)


@pytest.mark.parametrize("seqs, num_pad_tokens, page_size", [
    (RAGGED, 3, 16),
    ([(0, 300), (0, 1), (200, 130), (5, 128)], 50, 16),  # runs of several blocks, exactly one block, padding
    ([(0, 129)], 300, 256),  # more padding tokens than a block; pages larger than a key block
])
def test_mosaic_gpu_block_schedule_covers_every_token_once(seqs, num_pad_tokens, page_size):
    # The Mosaic GPU kernel cannot run on CPU; its schedule (plain jnp) can. Each token must sit in
    # exactly one block, as a run of one sequence's consecutive positions, padding tokens in blocks
    # without keys (so the kernel writes their zeros), real blocks with exactly their key range.
    from jaxinfer.kernels.attention import prefill_mgpu

    _, _, _, md, num_real = make_step(seqs, heads=4, kv_heads=2, head_dim=64, page_size=page_size,
                                      dtype=jnp.float32, num_pad_tokens=num_pad_tokens)
    pages_per_seq = md.block_tables.shape[1]
    meta = np.asarray(prefill_mgpu.block_schedule(md.positions, md.token_seq_ids, md.seq_lens, page_size=page_size, pages_per_seq=pages_per_seq))
    positions, seq_ids = np.asarray(md.positions), np.asarray(md.token_seq_ids)
    seq_lens = np.asarray(md.seq_lens)
    block_q, block_kv = prefill_mgpu.COMPUTE_WGS * prefill_mgpu.BLOCK_Q, prefill_mgpu.BLOCK_KV
    covered = np.zeros(len(positions), int)
    used = meta[meta[:, 5] > 0]
    assert (meta[: len(meta) - len(used), 5] == 0).all()  # unused blocks first, then the used ones
    for seq, num_kb, kv_end, first_tok, first_pos, num_rows, _, _ in used:
        assert num_rows <= block_q
        toks = np.arange(first_tok, first_tok + num_rows)
        covered[toks] += 1
        if first_tok >= num_real:  # a padding block
            assert (toks >= num_real).all() and num_kb == 0 and kv_end == 0
            continue
        assert (toks < num_real).all() and (seq_ids[toks] == seq).all()
        np.testing.assert_array_equal(positions[toks], first_pos + np.arange(num_rows))
        assert kv_end == min(positions[toks[-1]] + 1, seq_lens[seq])
        assert num_kb == -(-kv_end // block_kv)
    np.testing.assert_array_equal(covered, 1)
    # The longest key ranges first (the grid's order): per sequence, blocks in decreasing position.
    for seq in set(used[:, 0]) - {-1}:
        starts = used[used[:, 0] == seq, 4]
        assert (np.diff(starts) < 0).all()
