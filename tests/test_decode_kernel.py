"""The Pallas paged decode kernel against the reference, in Pallas interpret mode on CPU.

The same comparison at realistic shapes on the GPU is in scripts/gpu_check.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.kernels.attention import reference
from jaxinfer.kernels.attention.decode_pallas import default_blocking, paged_decode_attention


def _case(num_seqs, heads, kv_heads, head_dim, page_size, pages_per_seq, lengths, dtype, seed=0):
    rng = np.random.RandomState(seed)
    num_pages = num_seqs * pages_per_seq + 3
    k = rng.randn(kv_heads, num_pages, page_size, head_dim)
    v = rng.randn(kv_heads, num_pages, page_size, head_dim)
    q = rng.randn(num_seqs, heads, head_dim)
    tables = rng.permutation(num_pages)[: num_seqs * pages_per_seq].reshape(num_seqs, pages_per_seq)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), jnp.asarray(tables, jnp.int32), jnp.asarray(lengths, jnp.int32)


def attention_options(name, heads, head_dim, page_size):
    """The attention keyword arguments of an options case: ``plain``, ``window``, ``softcap`` or
    ``sinks`` (any other name: plain)."""
    options = dict(scale=head_dim**-0.5)
    if name == "window":
        options["sliding_window"] = page_size + 5
    if name == "softcap":
        options["logit_softcap"] = 2.0
    if name == "sinks":
        options["sinks"] = jnp.asarray(np.random.RandomState(1).randn(heads), jnp.float32)
    return options


SHAPES = [
    (8, 2, 64, 16),    # GQA
    (4, 1, 128, 32),   # MQA
    (2, 2, 256, 16),   # MHA, large heads
    (8, 4, 64, 128),   # large pages
]
OPTIONS = ["plain", "window", "softcap", "sinks"]
# A slice of a page, or one or more whole pages per block; split (partial results merged by the
# combine kernel) or one pass that writes the output itself; several blocks per program (a loop) or
# one (no loop, masked loads).
BLOCKINGS = [(16, 2), (64, 2), (64, 1), (64, 4), (16, 16)]


def pairwise_cases(shapes, options, blockings):
    """Every option with every blocking once, the shapes taken in turn (a Latin square): each pair of
    shape, option and blocking meets in some case, for a fraction of the full product's cases."""
    return [(*shapes[(i + j) % len(shapes)], option, *blocking)
            for i, option in enumerate(options) for j, blocking in enumerate(blockings)]


@pytest.mark.parametrize("heads, kv_heads, head_dim, page_size, options, block_tokens, num_splits",
                         pairwise_cases(SHAPES, OPTIONS, BLOCKINGS))
def test_matches_reference(heads, kv_heads, head_dim, page_size, options, block_tokens, num_splits):
    pages_per_seq = max(2, 256 // page_size)
    max_len = pages_per_seq * page_size
    lengths = [0, 1, page_size + 3, max_len]  # 0: a padding row
    q, k, v, tables, lens = _case(4, heads, kv_heads, head_dim, page_size, pages_per_seq, lengths, jnp.float32)
    kwargs = attention_options(options, heads, head_dim, page_size)
    ref = reference.paged_decode_attention(q, k, v, tables, lens, **kwargs)
    out = paged_decode_attention(q, k, v, tables, lens, interpret=True, block_tokens=block_tokens,
                                 num_splits=num_splits, **kwargs)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5)


def test_bfloat16_and_default_blocking():
    q, k, v, tables, lens = _case(3, 8, 2, 64, 16, 8, [5, 77, 128], jnp.bfloat16, seed=2)
    ref = reference.paged_decode_attention(q, k, v, tables, lens, scale=0.125)
    out = paged_decode_attention(q, k, v, tables, lens, scale=0.125, interpret=True)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=3e-2)


@pytest.mark.parametrize("heads, kv_heads", [(12, 2), (32, 2), (2, 1)])
def test_query_group_padding(heads, kv_heads):
    # Groups of 6 (not a power of two: padded before the kernel), 16 (no padding) and 2 (padded to
    # 16 rows as the kernel loads them).
    q, k, v, tables, lens = _case(2, heads, kv_heads, 64, 16, 6, [5, 90], jnp.float32, seed=4)
    ref = reference.paged_decode_attention(q, k, v, tables, lens, scale=0.125)
    out = paged_decode_attention(q, k, v, tables, lens, scale=0.125, interpret=True, block_tokens=32)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5)


def test_default_blocking_fills_the_gpu():
    # ~32 KiB K blocks; one long sequence is split across many programs, many sequences are not.
    assert default_blocking(1, 8, 256, 16, 128, 2) == (128, 32)
    assert default_blocking(128, 8, 128, 16, 128, 2) == (64, 1)
    assert default_blocking(4, 1, 16, 128, 256, 4) == (32, 64)
    # A short context is split as far as it has blocks (a block in series costs more than the
    # combine), in 64-token blocks while 128-token ones would leave SMs idle.
    assert default_blocking(1, 4, 34, 16, 128, 2) == (64, 9)
    assert default_blocking(1, 8, 32, 16, 128, 2) == (64, 8)


@pytest.mark.parametrize("num_splits, head_dim", [(3, 64), (40, 128)])
def test_uneven_and_many_splits(num_splits, head_dim):
    # 3 splits do not divide the 10 blocks (the table is padded); 40 splits leave the combine more
    # partial results than one program holds (the jnp merge takes over).
    q, k, v, tables, lens = _case(3, 8, 2, head_dim, 16, 40, [1, 333, 640], jnp.float32, seed=3)
    sinks = jnp.asarray(np.random.RandomState(2).randn(8), jnp.float32)
    ref = reference.paged_decode_attention(q, k, v, tables, lens, scale=0.125, sinks=sinks)
    out = paged_decode_attention(q, k, v, tables, lens, scale=0.125, interpret=True, block_tokens=16,
                                 num_splits=num_splits, sinks=sinks)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5)
