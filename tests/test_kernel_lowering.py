"""The Pallas GPU kernels lower to Triton (or Mosaic GPU) for the GPU, checked on CPU-only machines.

Interpret mode (the other kernel tests) runs the kernels' jnp semantics; it does not check that
Pallas can turn them into Triton IR (supported ops, shapes, layouts). Lowering for the ``cuda``
platform does, without a GPU: the Triton compiler itself only runs there.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.kernels import attention, pdl
from jaxinfer.kernels.attention.decode_pallas import paged_decode_attention, rotary_paged_decode_attention
from jaxinfer.kernels.attention import prefill_mgpu
from jaxinfer.kernels.attention.prefill_pallas import ragged_paged_attention
from jaxinfer.kernels.attention.rotary_pallas import rotary_cache_write
from jaxinfer.kernels.linear.skinny_pallas import norm_project, project
from jaxinfer.kernels.mla import decode_pallas as mla_decode_pallas
from jaxinfer.kernels.moe.grouped_pallas import moe_mlp
from jaxinfer.kernels.moe.grouping_pallas import group_by_expert
from jaxinfer.kernels.moe.router_pallas import route
from jaxinfer.kernels.norm.rms_norm_pallas import add_rms_norm
from jaxinfer.kernels.registry import Target
from jaxinfer.kernels.sparse_mla import attention_pallas as sparse_attention_pallas
from jaxinfer.kernels.sparse_mla import indexer_pallas

S = jax.ShapeDtypeStruct
BF16, I32 = jnp.bfloat16, jnp.int32


def _lower_for_gpu(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("batch, context, options", [
    (1, 4096, {}),
    (32, 4096, {"sliding_window": 128, "logit_softcap": 30.0}),
    (1, 131072, {}),  # more splits than one combine program holds: the jnp merge
])
@pytest.mark.parametrize("heads", [32, 48])  # query groups of 4 (padded in the kernel) and 6 (before it)
def test_decode_lowers(batch, context, options, heads):
    pages = context // 16
    text = _lower_for_gpu(functools.partial(paged_decode_attention, scale=0.1, **options),
                          S((batch, heads, 128), BF16), S((8, batch * pages, 16, 128), BF16),
                          S((8, batch * pages, 16, 128), BF16), S((batch, pages), I32), S((batch,), I32))
    assert "paged_decode_attention" in text


@pytest.mark.parametrize("num_splits", [1, 8])
def test_decode_with_sinks_lowers(num_splits):
    # One pass adds the sinks itself; split, the combine kernel adds them.
    args = (S((4, 64, 64), BF16), S((8, 1024, 16, 64), BF16), S((8, 1024, 16, 64), BF16), S((4, 256), I32),
            S((4,), I32), S((64,), jnp.float32))
    text = _lower_for_gpu(lambda q, k, v, bt, n, sinks: paged_decode_attention(q, k, v, bt, n, scale=0.1, sinks=sinks,
                                                                               num_splits=num_splits), *args)
    assert ("paged_decode_combine" in text) == (num_splits > 1)


@pytest.mark.parametrize("batch, context, qk_norm, options", [
    (1, 512, True, {}),  # Qwen3-30B-A3B at batch 1: split, one block per program
    (32, 4096, False, {"sinks": True, "sliding_window": 128}),  # GPT-OSS-like: one pass with sinks
])
def test_rotary_decode_lowers(batch, context, qk_norm, options):
    heads, kv_heads, pages = 32, 4, context // 16
    norms = (S((128,), BF16), S((128,), BF16)) if qk_norm else (None, None)
    sinks = S((heads,), jnp.float32) if options.get("sinks") else None
    window = options.get("sliding_window")
    text = _lower_for_gpu(
        lambda q, k, v, cos, sin, kc, vc, slots, bt, n, qn, kn, sk: rotary_paged_decode_attention(
            q, k, v, cos, sin, kc, vc, slots, bt, n, scale=0.1, q_norm=qn, k_norm=kn, sinks=sk, sliding_window=window),
        S((batch, heads, 128), BF16), S((batch, kv_heads, 128), BF16), S((batch, kv_heads, 128), BF16),
        S((batch, 128), jnp.float32), S((batch, 128), jnp.float32), S((kv_heads, batch * pages, 16, 128), BF16),
        S((kv_heads, batch * pages, 16, 128), BF16), S((batch,), I32), S((batch, pages), I32), S((batch,), I32),
        *norms, sinks)
    assert "rotary_paged_decode_attention" in text and "rotary_cache_write" not in text


@pytest.mark.parametrize("heads, kv_heads, head_dim, page_size", [(32, 32, 128, 16), (32, 8, 128, 16),
                                                                  (8, 2, 256, 64)])
def test_prefill_lowers(heads, kv_heads, head_dim, page_size):
    t, seqs, pages = 2048, 4, 64
    ragged = (S((t,), I32), S((t,), I32), S((seqs, pages), I32), S((seqs,), I32))  # positions, seq ids, tables, lens
    text = _lower_for_gpu(functools.partial(ragged_paged_attention, scale=0.1),
                          S((t, heads, head_dim), BF16), S((kv_heads, seqs * pages, page_size, head_dim), BF16),
                          S((kv_heads, seqs * pages, page_size, head_dim), BF16), *ragged)
    assert "ragged_paged_prefill" in text


@pytest.mark.parametrize("heads, kv_heads, head_dim, page_size, heads_per_program", [
    (32, 8, 128, 16, None), (8, 1, 64, 32, None), (4, 4, 128, 256, None),
    (32, 8, 128, 16, 2), (4, 4, 128, 256, 2),  # two heads in turn per program: GQA and MHA
])
def test_prefill_mosaic_gpu_lowers(heads, kv_heads, head_dim, page_size, heads_per_program):
    # The warp-specialised kernel (Mosaic GPU) lowers for the GPU on a CPU-only machine too.
    t, seqs, pages = 1000, 3, 32
    ragged = (S((t,), I32), S((t,), I32), S((seqs, pages), I32), S((seqs,), I32))  # positions, seq ids, tables, lens
    text = _lower_for_gpu(functools.partial(prefill_mgpu.ragged_paged_attention, scale=0.1,
                                            heads_per_program=heads_per_program),
                          S((t, heads, head_dim), BF16), S((kv_heads, seqs * pages, page_size, head_dim), BF16),
                          S((kv_heads, seqs * pages, page_size, head_dim), BF16), *ragged)
    assert "mosaic_gpu" in text


def test_prefill_mosaic_gpu_pairs_heads_only_where_programs_fill_the_gpu():
    # 1 x 8192 tokens, 32 heads: 67 blocks -> 1072 pairs, over 6 waves of 132 SMs; 2 x 2048, 16 heads does not.
    assert prefill_mgpu.default_heads_per_program(67 * 32, 32, 132) == 2
    assert prefill_mgpu.default_heads_per_program(37 * 16, 16, 132) == 1
    assert prefill_mgpu.default_heads_per_program(67 * 33, 33, 132) == 1  # odd head count
    ragged = (S((64,), I32), S((64,), I32), S((1, 4), I32), S((1,), I32))
    for bad in (3, 0):
        with pytest.raises(ValueError, match=f"heads_per_program={bad} does not divide the 4 query heads"):
            _lower_for_gpu(functools.partial(prefill_mgpu.ragged_paged_attention, scale=0.1, heads_per_program=bad),
                           S((64, 4, 128), BF16), S((4, 4, 16, 128), BF16), S((4, 4, 16, 128), BF16), *ragged)


def test_prefill_mosaic_gpu_refuses_what_it_does_not_take():
    q, cache = jnp.zeros((8, 4, 128), BF16), jnp.zeros((4, 2, 16, 128), BF16)
    assert prefill_mgpu.supports(q, cache)
    assert not prefill_mgpu.supports(q, cache, sliding_window=64)
    assert not prefill_mgpu.supports(q.astype(jnp.float32), cache.astype(jnp.float32))
    assert not prefill_mgpu.supports(jnp.zeros((8, 4, 256), BF16), jnp.zeros((4, 2, 16, 256), BF16))
    with pytest.raises(ValueError, match="does not take"):
        prefill_mgpu.ragged_paged_attention(q.astype(jnp.float32), cache.astype(jnp.float32),
                                            cache.astype(jnp.float32), None, None, None, None, scale=0.1)


HOPPER = Target(platform="gpu", device_kind="NVIDIA H200", compute_capability="9.0", sm_count=132)


@pytest.mark.parametrize("options, target, expected", [
    ({}, HOPPER, "mgpu"),
    ({"sliding_window": None, "logit_softcap": None, "sinks": None}, HOPPER, "mgpu"),
    ({"sliding_window": 64}, HOPPER, "triton"),
    ({"block_q": 64}, HOPPER, "triton"),  # Triton tuning options go to the Triton kernel
    ({}, dataclasses.replace(HOPPER, compute_capability="8.0"), "triton"),  # not a Hopper GPU
    ({}, Target.interpreted(), "triton"),  # interpret mode (CPU tests)
    ({}, Target.of_device(jax.devices("cpu")[0]), "reference"),
])
def test_gpu_prefill_picks_the_kernel_that_takes_the_call(options, target, expected):
    q, cache = jnp.zeros((8, 4, 128), BF16), jnp.zeros((4, 2, 16, 128), BF16)
    ragged = (jnp.zeros(8, I32), jnp.zeros(8, I32), jnp.zeros((1, 2), I32), jnp.ones(1, I32))
    chosen = attention.ragged_paged_attention_op.choose(target, q, cache, cache, *ragged, scale=0.1, **options)
    assert chosen.name == expected


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, grouping_kernels", [
    (1, 128, 8, 2048, 768, False), (4096, 128, 8, 2048, 768, True),
    (8, 32, 4, 2880, 2880, True)])  # 32 pairs over blocks of 16 rows, distinct experts not promised
def test_moe_lowers(tokens, experts, top_k, hidden, inter, grouping_kernels):
    text = _lower_for_gpu(moe_mlp, S((tokens, hidden), BF16), S((tokens, top_k), I32), S((tokens, top_k), BF16),
                          S((experts, inter, hidden), BF16), S((experts, inter, hidden), BF16),
                          S((experts, hidden, inter), BF16))
    assert "moe_gate_up" in text and "moe_down" in text
    assert ("moe_group_place" in text) == grouping_kernels


@pytest.mark.parametrize("pairs, experts, block_m", [(32768, 128, 128), (1000, 300, 16), (16384, 32, 128)])
def test_moe_grouping_lowers(pairs, experts, block_m):
    text = _lower_for_gpu(lambda ids: group_by_expert(ids, experts, block_m), S((pairs, 1), I32))
    assert "moe_group_count" in text and "moe_group_place" in text


@pytest.mark.parametrize("router, tokens, experts, top_k", [("softmax_topk", 1, 128, 8), ("topk_softmax", 4096, 32, 4),
                                                            ("sigmoid_bias", 7, 256, 6)])
def test_router_lowers(router, tokens, experts, top_k):
    text = _lower_for_gpu(lambda logits, bias: route(logits, router=router, top_k=top_k, correction_bias=bias),
                          S((tokens, experts), BF16), S((experts,), jnp.float32))
    assert "moe_route" in text


@pytest.mark.parametrize("tokens, heads, kv_heads, rotary_dim, qk_norm", [
    (1, 32, 4, 128, True),     # Qwen3 decode
    (8192, 32, 8, 128, False),  # Llama prefill
    (16, 16, 2, 64, False),    # partial rotary
])
def test_rotary_cache_write_lowers(tokens, heads, kv_heads, rotary_dim, qk_norm):
    norms = (S((128,), BF16), S((128,), BF16)) if qk_norm else (None, None)
    text = _lower_for_gpu(lambda q, k, v, cos, sin, kc, vc, slots, qn, kn: rotary_cache_write(
        q, k, v, cos, sin, kc, vc, slots, q_norm=qn, k_norm=kn),
        S((tokens, heads, 128), BF16), S((tokens, kv_heads, 128), BF16), S((tokens, kv_heads, 128), BF16),
        S((tokens, rotary_dim), jnp.float32), S((tokens, rotary_dim), jnp.float32),
        S((kv_heads, 600, 16, 128), BF16), S((kv_heads, 600, 16, 128), BF16), S((tokens,), I32), *norms)
    assert "rotary_cache_write" in text


@pytest.mark.parametrize("rows, hidden, residual", [(1, 2048, True), (8192, 4096, True), (3, 2880, False)])
def test_add_rms_norm_lowers(rows, hidden, residual):
    if residual:
        fn = lambda x, r, w: add_rms_norm(x, r, w, 1e-6)  # noqa: E731
        args = (S((rows, hidden), BF16), S((rows, hidden), BF16), S((hidden,), BF16))
    else:
        fn = lambda x, w: add_rms_norm(x, None, w, 1e-6, float32_weight=True)  # noqa: E731
        args = (S((rows, hidden), BF16), S((hidden,), BF16))
    assert "add_rms_norm" in _lower_for_gpu(fn, *args)


@pytest.mark.parametrize("rows, out_features, in_features, bias", [
    (1, (4096, 512, 512), 2048, False),  # Qwen3-30B-A3B q/k/v at one token
    (1, (2880,), 4096, True),            # not a multiple of the block, with a bias
    (8, (128,), 2048, False),            # tensor-core path
])
def test_project_lowers(rows, out_features, in_features, bias):
    weights = tuple(S((n, in_features), BF16) for n in out_features)
    biases = tuple(S((n,), BF16) for n in out_features) if bias else None
    text = _lower_for_gpu(lambda x, w, b: project(x, w, b), S((rows, in_features), BF16), weights, biases)
    assert "project_block_n" in text


@pytest.mark.parametrize("out_features, in_features, bias", [
    ((4096, 512, 512), 2048, False),  # Qwen3-30B-A3B q/k/v after its input norm
    ((2880, 2880), 2880, True),       # a row not a multiple of the block, with biases
])
def test_norm_project_lowers(out_features, in_features, bias):
    weights = tuple(S((n, in_features), BF16) for n in out_features)
    biases = tuple(S((n,), BF16) for n in out_features) if bias else None
    text = _lower_for_gpu(lambda x, g, w, b: norm_project(x, g, w, b, eps=1e-6), S((1, in_features), BF16),
                          S((in_features,), BF16), weights, biases)
    assert "norm_project_block_n" in text


_TRIGGER = "griddepcontrol.launch_dependents"


def _decode_step_kernels():
    """Each kernel family of the decode step -> (fn, args) lowering a call that launches one of its kernels
    (the attention call also launches the merge kernel, the expert call both expert kernels)."""
    moe = (moe_mlp, (S((1, 2048), BF16), S((1, 8), I32), S((1, 8), BF16), S((128, 768, 2048), BF16),
                     S((128, 768, 2048), BF16), S((128, 2048, 768), BF16)))
    attention = (functools.partial(paged_decode_attention, scale=0.1, num_splits=8),
                 (S((1, 32, 128), BF16), S((4, 64, 16, 128), BF16), S((4, 64, 16, 128), BF16), S((1, 64), I32),
                  S((1,), I32)))
    return {
        "rms_norm": (lambda x, w: add_rms_norm(x, None, w, 1e-6), (S((1, 2048), BF16), S((2048,), BF16))),
        "projection": (lambda x, w: project(x, (w,)), (S((1, 4096), BF16), S((2048, 4096), BF16))),
        "moe_route": (lambda logits: route(logits, router="softmax_topk", top_k=8), (S((1, 128), BF16),)),
        "moe_gate_up": moe,
        "moe_down": moe,
        "decode_attention": attention,
        "decode_combine": attention,
    }


@pytest.mark.parametrize("family", sorted(pdl.DEFAULT_POINTS))
def test_decode_step_kernels_trigger_the_next_launch_early(family):
    fn, args = _decode_step_kernels()[family]
    triggered = _lower_for_gpu(fn, *args).count(_TRIGGER)
    assert triggered >= 1
    with pdl.trigger_points({family: "none"}):  # one kernel of the call fewer
        assert _lower_for_gpu(fn, *args).count(_TRIGGER) == triggered - 1
    assert _lower_for_gpu(fn, *args).count(_TRIGGER) == triggered  # the default again after the block


def test_trigger_points_refuse_unknown_names():
    with pytest.raises(ValueError, match="unknown kernel family 'moe_gate'"):
        with pdl.trigger_points({"moe_gate": "none"}):
            pass
    with pytest.raises(ValueError, match="trigger point 'end'"):
        with pdl.trigger_points({"moe_down": "end"}):
            pass
    with pytest.raises(ValueError, match="unknown kernel family"):
        pdl.with_trigger(lambda: None, "attention")


def test_interpreted_kernels_carry_no_trigger():
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    assert pdl.with_trigger(kernel, "rms_norm", interpret=True) is kernel
    assert pdl.with_trigger(kernel, "rms_norm") is not kernel


@pytest.mark.parametrize("batch, context, heads, dtype, merged", [
    (1, 4096, 128, BF16, True),  # DeepSeek-V3 at one sequence: 32 splits, then the merge kernel
    (128, 2048, 128, BF16, False),  # enough programs at one split: the main kernel writes the output
    (4, 8192, 16, BF16, True),  # the heads of one shard of 8-way tensor parallelism
    (3, 4096, 128, jnp.float32, True),
])
def test_mla_decode_lowers(batch, context, heads, dtype, merged):
    pages = context // 64
    text = _lower_for_gpu(functools.partial(mla_decode_pallas.mla_paged_decode_attention, scale=0.1),
                          S((batch, heads, 512), dtype), S((batch, heads, 64), dtype),
                          S((batch * pages + 1, 64, 576), dtype), S((batch, pages), I32), S((batch,), I32))
    assert "mla_paged_decode_attention" in text
    assert ("mla_paged_decode_combine" in text) == merged


@pytest.mark.parametrize("heads, latent_dim, rope_dim, page_size, tuning", [
    (4, 32, 16, 4, {}),  # heads padded to 16, one block, one split
    (12, 128, 32, 16, {"block_keys": 16, "num_splits": 3}),  # 3 splits in 4 merge slots
    (32, 64, 16, 8, {"block_heads": 16, "block_keys": 16, "num_splits": 1}),  # 2 head blocks, a key loop
])
def test_mla_decode_lowers_at_small_shapes(heads, latent_dim, rope_dim, page_size, tuning):
    text = _lower_for_gpu(functools.partial(mla_decode_pallas.mla_paged_decode_attention, scale=0.1, **tuning),
                          S((3, heads, latent_dim), jnp.float32), S((3, heads, rope_dim), jnp.float32),
                          S((20, page_size, latent_dim + rope_dim), jnp.float32), S((3, 6), I32), S((3,), I32))
    assert "mla_paged_decode_attention" in text


def test_mla_decode_kernels_trigger_the_next_launch_early():
    # The MLA decode kernel and its merge belong to the decode-step families "decode_attention" and
    # "decode_combine": each triggers at its start unless its family's point says otherwise.
    fn = functools.partial(mla_decode_pallas.mla_paged_decode_attention, scale=0.1)
    args = (S((1, 128, 512), BF16), S((1, 128, 64), BF16), S((64, 64, 576), BF16), S((1, 64), I32), S((1,), I32))
    assert _lower_for_gpu(fn, *args).count(_TRIGGER) == 2
    for family in ("decode_attention", "decode_combine"):
        with pdl.trigger_points({family: "none"}):
            assert _lower_for_gpu(fn, *args).count(_TRIGGER) == 1


@pytest.mark.parametrize("tokens, heads, top_k, num_splits",
                         [(1, 128, 2048, 1), (1, 128, 2048, 16), (64, 16, 2048, 1), (4096, 128, 512, 1)])
def test_sparse_mla_attention_lowers(tokens, heads, top_k, num_splits):
    """Each token over its selected latent rows: decode at DeepSeek-V3.2's shape, in one program per
    head block and in 16 splits and their merge; a prefill chunk of one 8-way tensor-parallel shard;
    a long chunk with fewer slots."""
    text = _lower_for_gpu(functools.partial(sparse_attention_pallas.sparse_mla_attention, scale=0.1,
                                            num_splits=num_splits),
                          S((tokens, heads, 512), BF16), S((tokens, heads, 64), BF16), S((1024, 64, 576), BF16),
                          S((tokens, top_k), I32))
    assert "sparse_mla_attention" in text
    assert ("sparse_mla_combine" in text) == (num_splits > 1)


@pytest.mark.parametrize("tokens, pages_per_seq", [(1, 512), (32, 128)])
def test_indexer_scores_lower(tokens, pages_per_seq):
    """DeepSeek-V3.2's indexer (64 heads of 128) at decode over 32k tokens, and 32 sequences of 8k."""
    text = _lower_for_gpu(functools.partial(indexer_pallas.indexer_scores, scale=128 ** -0.5),
                          S((tokens, 64, 128), BF16), S((tokens, 64), jnp.float32), S((8192, 64, 128), BF16),
                          S((tokens,), I32), S((tokens,), I32), S((tokens, pages_per_seq), I32))
    assert "indexer_scores" in text


def test_indexer_select_lowers_for_a_long_prefill():
    """4096 new tokens over a 32k-token block table: the scores kernel in query tiles, XLA's top-k."""
    text = _lower_for_gpu(functools.partial(indexer_pallas.indexer_select, scale=128 ** -0.5, top_k=2048),
                          S((4096, 64, 128), BF16), S((4096, 64), jnp.float32), S((1024, 64, 128), BF16),
                          S((4096,), I32), S((4096,), I32), S((1, 512), I32))
    assert "indexer_scores" in text
