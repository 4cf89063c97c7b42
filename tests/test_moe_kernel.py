"""The Pallas grouped-GEMM MoE kernel (interpret mode, CPU) against the plain-jnp reference.

The same comparison at the real shapes (and benchmarks) on the GPU is in scripts/moe_check.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.kernels.moe import grouped_pallas, grouping, grouping_pallas, reference


def make_ids(rng, num_tokens, top_k, num_experts, dist):
    """Expert ids [T, k]: ``uniform``, ``uneven`` (expert 0 takes half the mass, the last three none),
    ``duplicates`` (drawn with replacement: a token may pick one expert twice) or ``dropped`` (drawn
    distinct from twice the experts, as one of two expert-parallel devices sees them: the other
    device's ids -1, one of them out of range instead)."""
    if dist == "duplicates":
        return rng.randint(0, num_experts, size=(num_tokens, top_k)).astype(np.int32)
    if dist == "dropped":
        ids = np.stack([rng.choice(2 * num_experts, top_k, replace=False) for _ in range(num_tokens)])
        ids = np.where(ids < num_experts, ids, -1).astype(np.int32)
        dropped = np.argwhere(ids < 0)
        if len(dropped):
            ids[tuple(dropped[0])] = 2 * num_experts  # out of range rather than -1: dropped all the same
        return ids
    p = np.ones(num_experts)
    if dist == "uneven":
        p[-3:] = 0.0
        p[0] = p[1:].sum()
    p /= p.sum()
    return np.stack([rng.choice(num_experts, top_k, replace=False, p=p) for _ in range(num_tokens)]).astype(np.int32)


def make_case(num_tokens, top_k, num_experts, hidden, inter, dtype, *, biases=(), dist="uniform", seed=0):
    rng = np.random.RandomState(seed)
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    x = cast(rng.randn(num_tokens, hidden))
    ids = make_ids(rng, num_tokens, top_k, num_experts, dist)
    weights = cast(rng.rand(num_tokens, top_k))
    params = dict(gate=cast(rng.randn(num_experts, inter, hidden) * hidden**-0.5),
                  up=cast(rng.randn(num_experts, inter, hidden) * hidden**-0.5),
                  down=cast(rng.randn(num_experts, hidden, inter) * inter**-0.5))
    sizes = dict(gate_bias=inter, up_bias=inter, down_bias=hidden)
    for name in biases:
        params[name] = cast(0.3 * rng.randn(num_experts, sizes[name]))
    return x, jnp.asarray(ids), weights, params


ALL_BIASES = ("gate_bias", "up_bias", "down_bias")
CASES = {
    # name: (T, k, E, H, I, dtype, activation, biases, distribution, kernel options)
    "decode-t1-silu-f32": (1, 2, 8, 80, 48, jnp.float32, "silu", (), "uniform", {}),
    "decode-t4-gptoss-bias-f32": (4, 4, 8, 80, 48, jnp.float32, "gpt_oss", ALL_BIASES, "uniform", {}),
    "decode-t2-gptoss-bias-bf16": (2, 2, 8, 80, 48, jnp.bfloat16, "gpt_oss", ALL_BIASES, "uniform", {}),
    # HY-V4's clamped SwiGLU, at a limit the activations cross.
    "decode-t4-swiglu-clamp-f32": (4, 2, 8, 80, 48, jnp.float32, "swiglu_clamp", (), "uniform", dict(limit=0.3)),
    # Distinct experts promised (as top-k routing gives): decode-sized steps group without a sort.
    "decode-t6-distinct-silu-f32": (6, 3, 8, 80, 48, jnp.float32, "silu", (), "uniform",
                                    dict(distinct_experts=True)),
    "prefill-uneven-silu-f32": (100, 2, 8, 80, 48, jnp.float32, "silu", (), "uneven", {}),
    "prefill-uneven-gptoss-bias-f32": (100, 4, 8, 80, 48, jnp.float32, "gpt_oss", ALL_BIASES, "uneven", {}),
    "prefill-uneven-silu-bias-bf16": (96, 2, 8, 80, 48, jnp.bfloat16, "silu", ALL_BIASES, "uneven", {}),
    "prefill-k1-gptoss-bf16": (100, 1, 8, 80, 48, jnp.bfloat16, "gpt_oss", (), "uneven", {}),
    # Blocks that do not divide H (80) or I (48): masked weight/x loads, padded intermediates, and
    # several row blocks per expert.
    "prefill-masked-blocks-gptoss-bias-f32": (100, 2, 8, 80, 48, jnp.float32, "gpt_oss", ALL_BIASES, "uneven",
                                              dict(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)),
    # H and I not multiples of 16: the default blocks cannot divide them, so every load is masked.
    "odd-dims-gptoss-bias-f32": (5, 2, 4, 72, 40, jnp.float32, "gpt_oss", ALL_BIASES, "uniform", {}),
    "pow2-silu-bf16": (40, 2, 4, 64, 32, jnp.bfloat16, "silu", (), "uniform", {}),
    # A token picking one expert twice; only some of the biases.
    "duplicates-partial-bias-f32": (8, 3, 4, 80, 48, jnp.float32, "silu", ("up_bias", "down_bias"), "duplicates",
                                    {}),
    # Other devices' experts (expert parallelism): dropped at one token, at a decode-sized step (the
    # sort-free grouping) and at prefill (the grouping kernels).
    "dropped-t1-gptoss-bias-f32": (1, 4, 8, 80, 48, jnp.float32, "gpt_oss", ALL_BIASES, "dropped",
                                   dict(distinct_experts=True)),
    "dropped-t6-distinct-silu-bias-f32": (6, 3, 8, 80, 48, jnp.float32, "silu", ALL_BIASES, "dropped",
                                          dict(distinct_experts=True)),
    "dropped-prefill-gptoss-bias-f32": (100, 4, 8, 80, 48, jnp.float32, "gpt_oss", ALL_BIASES, "dropped", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case):
    t, k, e, h, i, dtype, activation, biases, dist, options = CASES[case]
    x, ids, weights, params = make_case(t, k, e, h, i, dtype, biases=biases, dist=dist)
    if dist == "uneven":  # the case really is uneven: idle experts, and one expert with many rows
        loads = np.bincount(np.asarray(ids).ravel(), minlength=e)
        assert (loads == 0).sum() >= 3 and loads.max() > 32
    limit = {"limit": options["limit"]} if "limit" in options else {}
    ref = reference.moe_mlp(x, ids, weights, **params, activation=activation, **limit)
    out = grouped_pallas.moe_mlp(x, ids, weights, **params, activation=activation, interpret=True, **options)
    assert out.shape == (t, h) and out.dtype == x.dtype
    ref = np.asarray(ref, np.float32)
    out = np.asarray(out, np.float32)
    scale = np.abs(ref).max()
    assert scale > 0.1  # a non-trivial output
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("num_tokens, top_k, num_experts, block_m, dist", [
    (3, 2, 8, 16, "uniform"),     # decode-sized: one block per touched expert
    (100, 4, 8, 16, "uneven"),    # several blocks for the busy expert, idle experts
    (50, 1, 8, 16, "uneven"),     # k = 1
    (20, 3, 4, 16, "duplicates"),  # a token's slots on one expert
])
def test_grouping(num_tokens, top_k, num_experts, block_m, dist):
    ids = make_ids(np.random.RandomState(1), num_tokens, top_k, num_experts, dist)
    g = grouping.group_by_expert(jnp.asarray(ids), num_experts, block_m)
    row_pair, block_expert, pair_row = (np.asarray(a) for a in g)
    num_pairs = num_tokens * top_k
    nb = grouping.num_row_blocks(num_pairs, num_experts, block_m)
    assert nb <= -(-num_pairs // block_m) + num_experts
    assert row_pair.shape == (nb * block_m,) and block_expert.shape == (nb,) and pair_row.shape == (num_pairs,)

    # Every (token, slot) sits in exactly one padded row, and pair_row points back at it.
    real = row_pair[row_pair >= 0]
    assert sorted(real.tolist()) == list(range(num_pairs))
    np.testing.assert_array_equal(row_pair[pair_row], np.arange(num_pairs))
    assert (row_pair[row_pair < 0] == -1).all()  # padding rows are marked -1

    # Each row block holds one expert's rows; the used blocks come first, with the experts in order,
    # each expert taking exactly cdiv(load, block_m) blocks; unused blocks are -1 and all padding.
    flat = ids.ravel()
    loads = np.bincount(flat, minlength=num_experts)
    blocks = row_pair.reshape(nb, block_m)
    used = int((-(-loads // block_m)).sum())
    assert (block_expert[:used] >= 0).all() and (block_expert[used:] == -1).all()
    assert (blocks[used:] == -1).all()
    assert (np.diff(block_expert[:used]) >= 0).all()
    np.testing.assert_array_equal(np.bincount(block_expert[:used], minlength=num_experts), -(-loads // block_m))
    for b in range(used):
        rows = blocks[b][blocks[b] >= 0]
        assert len(rows) > 0 and (flat[rows] == block_expert[b]).all()
        assert (np.diff(rows) > 0).all()  # stable: an expert's pairs keep their order
        # Real rows first within a block: padding only at the end of an expert's group.
        assert (blocks[b][: len(rows)] >= 0).all()
    if dist == "uneven":
        assert (loads == 0).any() and loads.max() > block_m  # idle experts and a multi-block expert


@pytest.mark.parametrize("num_tokens, top_k, num_experts", [(1, 8, 128), (16, 8, 128), (1, 4, 32), (32, 4, 32)])
def test_decode_reads_each_touched_expert_once(num_tokens, top_k, num_experts):
    """Decode-sized calls give every touched expert exactly one row block (so one read of its
    weights) and untouched experts none; the grid's row blocks scale with the touched experts."""
    block_m = grouped_pallas.default_block_sizes(num_tokens, top_k, num_experts, 2048, 768)["block_m"]
    assert num_tokens * top_k <= grouped_pallas.DECODE_ROWS and 16 <= block_m <= 32
    rng = np.random.RandomState(2)
    ids = make_ids(rng, num_tokens, top_k, num_experts, "uniform")
    g = grouping.group_by_expert(jnp.asarray(ids), num_experts, block_m)
    block_expert = np.asarray(g.block_expert)
    touched = np.unique(ids)
    used = block_expert[block_expert >= 0]
    np.testing.assert_array_equal(np.sort(used), touched)  # one block each, no others
    # The grid is bounded by the touched experts, not by E (one token: exactly its k experts).
    num_pairs = num_tokens * top_k
    assert len(block_expert) <= min(num_experts, num_pairs) + -(-num_pairs // block_m)
    if num_tokens == 1:
        assert len(block_expert) == top_k


@pytest.mark.parametrize("hidden, inter", [(2048, 768), (2880, 2880)])  # Qwen3-30B-A3B, GPT-OSS-20B
@pytest.mark.parametrize("num_tokens, top_k, num_experts", [(1, 8, 128), (4096, 8, 128), (1, 4, 32),
                                                            (4096, 4, 32), (64, 8, 128)])
def test_default_block_sizes(hidden, inter, num_tokens, top_k, num_experts):
    cfg = grouped_pallas.default_block_sizes(num_tokens, top_k, num_experts, hidden, inter)
    if num_tokens == 1:
        assert cfg["block_m"] == 16
    if num_tokens == 4096:
        assert cfg["block_m"] == 128
    for kernel, (n_dim, k_dim) in (("gate_up", (inter, hidden)), ("down", (hidden, inter))):
        c = cfg[kernel]
        for b, dim in ((c["block_n"], n_dim), (c["block_k"], k_dim)):
            assert b >= 16 and b & (b - 1) == 0
        assert k_dim % c["block_k"] == 0  # the reduction runs without masking at the real shapes
        assert -(-n_dim // c["block_n"]) * c["block_n"] <= 1.125 * n_dim  # masked columns: at most 1/8
        assert c["num_warps"] in (4, 8) and 1 <= c["num_stages"] <= 4


def test_decode_down_pipeline_depth():
    # One token keeps 4 stages; from two tokens on the down kernel runs 3 (the faster setting there).
    stages = {t: grouped_pallas.default_block_sizes(t, 8, 128, 2048, 768)["down"]["num_stages"] for t in (1, 2, 8)}
    assert stages == {1: 4, 2: 3, 8: 3}


def test_rejects_bad_blocks_and_shapes():
    x, ids, weights, params = make_case(2, 2, 4, 80, 48, jnp.float32)
    with pytest.raises(ValueError, match="block_m"):
        grouped_pallas.moe_mlp(x, ids, weights, **params, interpret=True, block_m=24)
    with pytest.raises(ValueError, match="block_k"):
        grouped_pallas.moe_mlp(x, ids, weights, **params, interpret=True, block_k=8)
    with pytest.raises(ValueError, match="expert weights"):
        grouped_pallas.moe_mlp(x, ids, weights, params["gate"], params["up"], params["gate"], interpret=True)


@pytest.mark.parametrize("num_tokens, top_k, num_experts, dist", [
    (1, 8, 128, "uniform"), (16, 8, 128, "uniform"), (8, 4, 8, "uniform"), (5, 3, 4, "duplicates")])
def test_few_token_grouping_equals_the_sorted_one(num_tokens, top_k, num_experts, dist):
    """The comparison-based grouping for decode-sized steps gives exactly the sort-based result."""
    ids = jnp.asarray(make_ids(np.random.RandomState(4), num_tokens, top_k, num_experts, dist))
    block_m = max(16, num_tokens)
    want = grouping.group_by_expert(ids, num_experts, block_m)
    got = grouping.group_few_by_expert(ids, num_experts, block_m)
    for name, a, b in zip(want._fields, want, got):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)


@pytest.mark.parametrize("num_tokens, top_k, num_experts, block_m, dist", [
    (100, 4, 8, 16, "uneven"),     # several chunks, a multi-block expert, idle experts
    (300, 8, 128, 32, "uniform"),  # many experts: blocks past the last used one
    (70, 3, 20, 16, "duplicates"),  # experts not a power of two; a token's slots on one expert
    (9, 2, 300, 16, "uniform"),    # more experts than one tile of pairs holds: small chunks
])
def test_kernel_grouping_equals_the_sorted_one(num_tokens, top_k, num_experts, block_m, dist):
    """The two-launch prefill grouping (interpret mode) gives exactly the sort-based result."""
    ids = jnp.asarray(make_ids(np.random.RandomState(5), num_tokens, top_k, num_experts, dist))
    want = grouping.group_by_expert(ids, num_experts, block_m)
    got = grouping_pallas.group_by_expert(ids, num_experts, block_m, interpret=True)
    for name, a, b in zip(want._fields, want, got):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)


def test_one_token_grouping():
    """One token: row block j holds slot j (its expert), row 0 of the block; every other row is padding."""
    ids = jnp.asarray([[5, 1, 7, 3]], jnp.int32)
    g = grouping.group_one_token(ids, 16, 8)
    np.testing.assert_array_equal(np.asarray(g.block_expert), [5, 1, 7, 3])
    np.testing.assert_array_equal(np.asarray(g.pair_row), [0, 16, 32, 48])
    row_pair = np.asarray(g.row_pair).reshape(4, 16)
    np.testing.assert_array_equal(row_pair[:, 0], [0, 1, 2, 3])
    assert (row_pair[:, 1:] == -1).all()
    assert len(g.block_expert) == grouping.num_row_blocks(4, 8, 16)


def test_one_token_grouping_drops_other_experts():
    """A dropped slot's block has expert -1 (the kernels skip it) and the slot no row."""
    g = grouping.group_one_token(jnp.asarray([[5, -1, 9, 3]], jnp.int32), 16, 8)
    np.testing.assert_array_equal(np.asarray(g.block_expert), [5, -1, -1, 3])
    np.testing.assert_array_equal(np.asarray(g.pair_row), [0, -1, -1, 48])


@pytest.mark.parametrize("num_tokens, top_k, num_experts, block_m", [
    (5, 3, 8, 16),     # decode-sized
    (100, 4, 8, 16),   # prefill: several chunks, multi-block experts
    (9, 2, 300, 16),   # more experts than one tile of pairs holds
])
def test_dropped_pairs_take_no_row(num_tokens, top_k, num_experts, block_m):
    """Ids outside [0, E) take no row and make no block; the kept pairs are grouped as if the dropped
    ones were not there; the sort-free and kernel groupings give exactly the sorted one."""
    ids = make_ids(np.random.RandomState(6), num_tokens, top_k, num_experts, "dropped")
    flat = ids.ravel()
    kept = (flat >= 0) & (flat < num_experts)
    assert kept.any() and not kept.all()
    want = grouping.group_by_expert(jnp.asarray(ids), num_experts, block_m)
    row_pair, block_expert, pair_row = (np.asarray(a) for a in want)
    assert (pair_row[~kept] == -1).all() and (pair_row[kept] >= 0).all()
    assert sorted(row_pair[row_pair >= 0].tolist()) == np.nonzero(kept)[0].tolist()
    np.testing.assert_array_equal(row_pair[pair_row[kept]], np.nonzero(kept)[0])
    loads = np.bincount(flat[kept], minlength=num_experts)
    np.testing.assert_array_equal(np.bincount(block_expert[block_expert >= 0], minlength=num_experts),
                                  -(-loads // block_m))
    others = [grouping_pallas.group_by_expert(jnp.asarray(ids), num_experts, block_m, interpret=True)]
    if num_tokens <= block_m:
        others.append(grouping.group_few_by_expert(jnp.asarray(ids), num_experts, block_m))
    for got in others:
        for name, a, b in zip(want._fields, want, got):
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)
