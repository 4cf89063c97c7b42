"""The fused decode step (q/k norm, RoPE, cache write and paged decode attention in one kernel) against
the reference (``rotary_cache_write`` then ``paged_decode_attention``), in Pallas interpret mode on CPU.

The same comparison at realistic shapes on the GPU is in scripts/gpu_check.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.kernels.attention import reference
from jaxinfer.kernels.attention.decode_pallas import rotary_paged_decode_attention
from tests.test_decode_kernel import attention_options, pairwise_cases


def _case(lengths, heads, kv_heads, head_dim, page_size, pages_per_seq, rotary_dim, dtype, qk_norm, seed=0):
    """A decode step: sequence ``s`` holds ``lengths[s]`` tokens with its new one (0: a padding row,
    slot -1), its new token's slot is the block table's slot for position ``lengths[s] - 1``."""
    rng = np.random.RandomState(seed)
    num_seqs = len(lengths)
    num_pages = num_seqs * pages_per_seq + 3
    tables = rng.permutation(num_pages)[: num_seqs * pages_per_seq].reshape(num_seqs, pages_per_seq)
    slots = [int(tables[s, (n - 1) // page_size]) * page_size + (n - 1) % page_size if n else -1
             for s, n in enumerate(lengths)]
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    args = dict(
        q=cast(rng.randn(num_seqs, heads, head_dim)), k=cast(rng.randn(num_seqs, kv_heads, head_dim)),
        v=cast(rng.randn(num_seqs, kv_heads, head_dim)),
        cos=jnp.asarray(rng.randn(num_seqs, rotary_dim), jnp.float32),
        sin=jnp.asarray(rng.randn(num_seqs, rotary_dim), jnp.float32),
        k_cache=cast(rng.randn(kv_heads, num_pages, page_size, head_dim)),
        v_cache=cast(rng.randn(kv_heads, num_pages, page_size, head_dim)),
        slot_mapping=jnp.asarray(slots, jnp.int32), block_tables=jnp.asarray(tables, jnp.int32),
        seq_lens=jnp.asarray(lengths, jnp.int32))
    norms = {}
    if qk_norm:
        norms = dict(q_norm=cast(1 + 0.1 * rng.randn(head_dim)), k_norm=cast(1 + 0.1 * rng.randn(head_dim)),
                     norm_eps=1e-6)
    return args, norms


def _run_both(args, options, **tuning):
    want = reference.rotary_paged_decode_attention(**args, **options)
    copies = {name: jnp.array(a) for name, a in args.items()}  # the kernel's caches are donated
    got = rotary_paged_decode_attention(**copies, interpret=True, **options, **tuning)
    return want, got


SHAPES = [
    (8, 2, 64, 16, 64),    # GQA, full rotary
    (4, 1, 128, 32, 64),   # MQA, partial rotary
    (8, 4, 64, 128, 32),   # large pages
]
OPTIONS = ["plain", "qk_norm", "window", "softcap", "sinks"]
# Split (merged by the combine kernel) or one pass; one block per program (no loop, its K/V read before
# or after the rotation) or several.
BLOCKINGS = [(16, 2, False), (64, 1, False), (16, 16, False), (16, 16, True)]


@pytest.mark.parametrize("heads, kv_heads, head_dim, page_size, rotary_dim, options, block_tokens, num_splits, "
                         "kv_reads_first", pairwise_cases(SHAPES, OPTIONS, BLOCKINGS))
def test_matches_reference(heads, kv_heads, head_dim, page_size, rotary_dim, options, block_tokens, num_splits,
                           kv_reads_first):
    pages_per_seq = max(2, 256 // page_size)
    lengths = [0, 1, page_size + 3, pages_per_seq * page_size]  # a padding row, a first token, a full table
    args, norms = _case(lengths, heads, kv_heads, head_dim, page_size, pages_per_seq, rotary_dim, jnp.float32,
                        qk_norm=options == "qk_norm")
    attention = attention_options(options, heads, head_dim, page_size)  # "qk_norm": plain attention
    want, got = _run_both(args, {**norms, **attention}, block_tokens=block_tokens, num_splits=num_splits,
                          kv_reads_first=kv_reads_first)
    for name, w, g in zip(("out", "k_cache", "v_cache"), want, got):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert np.isfinite(np.asarray(g)).all(), name
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=2e-5, err_msg=name)


def test_bfloat16_with_norms_and_default_blocking():
    args, norms = _case([5, 77, 128], 8, 2, 64, 16, 8, 64, jnp.bfloat16, qk_norm=True, seed=2)
    want, got = _run_both(args, {**norms, "scale": 0.125})
    assert got[0].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), atol=3e-2)
    for w, g in zip(want[1:], got[1:]):  # the cache rows are the same computation, rounded the same way
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_shapes_the_kernel_does_not_take_run_the_two_ops():
    # 6 heads over 2 KV heads (groups of 3): not a power of two, so rotary_cache_write then the
    # decode kernel; the results are the same.
    args, norms = _case([3, 40], 6, 2, 64, 16, 4, 64, jnp.float32, qk_norm=True, seed=3)
    want, got = _run_both(args, {**norms, "scale": 0.125})
    for w, g in zip(want, got):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=2e-5)


def test_unpaired_norm_weights_are_refused():
    args, norms = _case([3], 8, 2, 64, 16, 2, 64, jnp.float32, qk_norm=True)
    with pytest.raises(ValueError, match="q_norm and k_norm go together"):
        rotary_paged_decode_attention(**args, scale=0.125, q_norm=norms["q_norm"], interpret=True)
