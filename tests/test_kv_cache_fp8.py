"""``kv_cache_dtype="fp8"``: paged caches stored in float8_e4m3fn with a per-layer scale.

The write/read rule (``jaxinfer.cache.fp8``), the layout that allocates e4m3 arrays and their
scales, the Pallas kernels that read or write e4m3 against their references (interpret mode), tiny
llama and DeepSeek-V3 (MLA) models served with an fp8 cache against a float32 one, the checkpoint's
``k_scale`` / ``v_scale`` tensors, and the option's errors.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxinfer import LLM, load_model
from jaxinfer.cache import fp8
from jaxinfer.cache.checkpoint_scales import read_kv_scales
from jaxinfer.cache.layout import CacheLayout
from jaxinfer.cache.metadata import build_metadata
from jaxinfer.cache.specs import PagedKV, PagedLatent, StateSlots
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.sampling import SamplingParams
from jaxinfer.errors import CheckpointError, ConfigError
from jaxinfer.kernels import attention as attention_ops
from jaxinfer.kernels import registry
from jaxinfer.kernels import sparse_mla as sparse_ops
from jaxinfer.kernels.attention import prefill_pallas, reference
from jaxinfer.kernels.attention.decode_pallas import paged_decode_attention, rotary_paged_decode_attention
from jaxinfer.kernels.attention.rotary_pallas import rotary_cache_write
from jaxinfer.kernels.mla import decode_pallas as mla_decode
from jaxinfer.kernels.mla import reference as mla_reference
from jaxinfer.kernels.sparse_mla import attention_pallas as sparse_attention_pallas
from jaxinfer.kernels.sparse_mla import indexer_pallas
from jaxinfer.kernels.sparse_mla import reference as sparse_reference
from jaxinfer.weights import SafetensorsCheckpoint
from tests.conftest import make_hf_checkpoint, random_prompts
from tests.families import MLA, MLA_CASES
from tests.test_kernel_lowering import _lower_for_gpu
from tests.test_prefill_kernel import make_step
from tests.test_prefill_kernel import ragged as prefill_ragged

E4M3_STEP = 2.0 ** -3  # e4m3's relative spacing: 3 mantissa bits, so rounding is within half of it
S = jax.ShapeDtypeStruct


# ---- the rule --------------------------------------------------------------------------------------

def test_quantize_divides_clips_and_dequantize_multiplies():
    x = jnp.asarray([0.3, -1.7, 5.0, 900.0, -2000.0], jnp.float32)
    stored = fp8.quantize(x, fp8.FP8, jnp.float32(2.0))
    assert stored.dtype == fp8.FP8
    np.testing.assert_array_equal(np.asarray(stored.astype(jnp.float32))[3:], [448.0, -448.0])  # clipped
    back = np.asarray(fp8.dequantize(stored, jnp.float32(2.0)))
    np.testing.assert_allclose(back[:3], np.asarray(x)[:3], rtol=E4M3_STEP / 2)
    assert not np.array_equal(np.asarray(fp8.quantize(x, fp8.FP8, jnp.float32(1.0)).astype(jnp.float32)),
                              np.asarray(stored.astype(jnp.float32)))  # the scale is applied


def test_a_scale_goes_with_an_fp8_cache_only():
    with pytest.raises(ValueError, match="needs its scale"):
        fp8.check_scale(jnp.zeros((2,), fp8.FP8), None, "K")
    with pytest.raises(ValueError, match="not fp8"):
        fp8.check_scale(jnp.zeros((2,), jnp.float32), jnp.float32(1.0), "K")


@pytest.mark.parametrize("name", ["fp16", "int8", "FP8", None, 8])
def test_bad_kv_cache_dtype_is_a_config_error(name):
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        EngineConfig(kv_cache_dtype=name).validate()
    with pytest.raises(ConfigError, match="kv_cache_dtype"):  # before the checkpoint is even looked at
        LLM("/nonexistent/checkpoint", kv_cache_dtype=name)


# ---- the layout ------------------------------------------------------------------------------------

def test_layout_stores_paged_arrays_in_e4m3_with_scales_and_state_slots_as_they_are():
    specs = ((PagedKV(2, 16),), (PagedLatent(32, 8), StateSlots((("conv", (4, 8), None, (None, None)),))))
    auto = CacheLayout(specs, page_size=4, num_pages=3, dtype=jnp.bfloat16, num_slots=2)
    layout = CacheLayout(specs, page_size=4, num_pages=3, dtype=jnp.bfloat16, num_slots=2, kv_dtype=fp8.FP8,
                         kv_scales=((("k_scale", 0.5),), ()))
    assert {name: dtype for name, (_, dtype, _) in layout.layer_arrays(0).items()} == {
        "k": fp8.FP8, "v": fp8.FP8, "k_scale": np.float32, "v_scale": np.float32}
    assert {name: dtype for name, (_, dtype, _) in layout.layer_arrays(1).items()} == {
        "latent": fp8.FP8, "latent_scale": np.float32, "conv": jnp.bfloat16}
    assert layout.bytes_per_page * 2 == auto.bytes_per_page and layout.bytes_per_slot == auto.bytes_per_slot
    assert set(auto.layer_arrays(0)) == {"k", "v"}  # no scales without fp8
    caches = layout.zeros()
    assert [float(caches[0]["k_scale"]), float(caches[0]["v_scale"]), float(caches[1]["latent_scale"])] == [0.5, 1, 1]
    assert not np.any(np.asarray(caches[0]["k"].astype(jnp.float32)))


# ---- kernels against their references (interpret mode) ---------------------------------------------

def _fp8_cache(rng, kv_heads, num_pages, page_size, head_dim, scale):
    values = rng.randn(kv_heads, num_pages, page_size, head_dim) * 3.0
    return fp8.quantize(jnp.asarray(values, jnp.float32), fp8.FP8, jnp.float32(scale))


DECODE_CASES = [  # heads, kv_heads, head_dim, page_size, lengths, tuning, options
    (4, 2, 32, 8, [13, 1, 24], dict(block_tokens=16, num_splits=2), {}),  # split, merged by the combine kernel
    # A group of 3 (padded before the kernel), one pass that writes the output, a window, sinks.
    (6, 2, 16, 4, [7, 16], dict(block_tokens=16, num_splits=1), dict(sliding_window=5, sinks=True)),
]


@pytest.mark.parametrize("heads, kv_heads, head_dim, page_size, lengths, tuning, options", DECODE_CASES)
def test_decode_kernel_reads_e4m3_pages_with_their_scales(heads, kv_heads, head_dim, page_size, lengths, tuning,
                                                          options):
    rng = np.random.RandomState(0)
    pages_per_seq = -(-max(lengths) // page_size)
    num_pages = len(lengths) * pages_per_seq + 2
    k_scale, v_scale = jnp.float32(0.05), jnp.float32(3.0)
    k_cache = _fp8_cache(rng, kv_heads, num_pages, page_size, head_dim, 0.05)
    v_cache = _fp8_cache(rng, kv_heads, num_pages, page_size, head_dim, 3.0)
    q = jnp.asarray(rng.randn(len(lengths), heads, head_dim), jnp.float32)
    tables = jnp.asarray(rng.permutation(num_pages)[:len(lengths) * pages_per_seq].reshape(len(lengths), -1),
                         jnp.int32)
    seq_lens = jnp.asarray(lengths, jnp.int32)
    if options.pop("sinks", False):
        options["sinks"] = jnp.asarray(rng.randn(heads), jnp.float32)
    args = (q, k_cache, v_cache, tables, seq_lens)
    want = reference.paged_decode_attention(*args, scale=head_dim ** -0.5, k_scale=k_scale, v_scale=v_scale,
                                            **options)
    got = paged_decode_attention(*args, scale=head_dim ** -0.5, k_scale=k_scale, v_scale=v_scale, interpret=True,
                                 **tuning, **options)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    unscaled = reference.paged_decode_attention(*args, scale=head_dim ** -0.5, k_scale=jnp.float32(1.0),
                                                v_scale=jnp.float32(1.0), **options)
    assert np.abs(np.asarray(unscaled) - np.asarray(want)).max() > 0.1  # the scales matter at these values


def _rotary_inputs(rng, tokens, heads, kv_heads, head_dim, rotary_dim, num_pages, page_size):
    positions = rng.randint(0, 50, size=tokens)
    inv = 1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    angles = np.concatenate([positions[:, None] * inv] * 2, axis=-1)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return dict(q=f32(rng.randn(tokens, heads, head_dim)), k=f32(rng.randn(tokens, kv_heads, head_dim) * 4),
                v=f32(rng.randn(tokens, kv_heads, head_dim) * 4), cos=f32(np.cos(angles)), sin=f32(np.sin(angles)),
                k_cache=jnp.zeros((kv_heads, num_pages, page_size, head_dim), fp8.FP8),
                v_cache=jnp.zeros((kv_heads, num_pages, page_size, head_dim), fp8.FP8))


def test_rotary_cache_write_stores_e4m3_as_the_reference():
    # A padding token, partial rotary and q/k norms.
    tokens, heads, kv_heads, head_dim, rotary_dim = 6, 8, 2, 32, 16
    rng = np.random.RandomState(1)
    num_pages, page_size = 12, 4
    args = _rotary_inputs(rng, tokens, heads, kv_heads, head_dim, rotary_dim, num_pages, page_size)
    slots = rng.permutation(num_pages * page_size)[:tokens]
    slots[1] = -1  # padding: not written
    norms = dict(q_norm=jnp.asarray(rng.rand(head_dim) + 0.5, jnp.float32),
                 k_norm=jnp.asarray(rng.rand(head_dim) + 0.5, jnp.float32))
    scales = dict(k_scale=jnp.float32(0.02), v_scale=jnp.float32(2.0))
    want = reference.rotary_cache_write(**args, slot_mapping=jnp.asarray(slots, jnp.int32), **norms, **scales)
    got = rotary_cache_write(**args, slot_mapping=jnp.asarray(slots, jnp.int32), **norms, **scales, interpret=True)
    np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=1e-5)
    for cache_got, cache_want in zip(got[1:], want[1:]):
        assert cache_got.dtype == fp8.FP8
        np.testing.assert_array_equal(np.asarray(cache_got.astype(jnp.float32)),
                                      np.asarray(cache_want.astype(jnp.float32)))


def test_fused_rotary_decode_with_an_e4m3_cache_matches_the_reference():
    rng = np.random.RandomState(2)
    num_seqs, heads, kv_heads, head_dim, page_size, pages_per_seq = 3, 4, 2, 16, 4, 4
    num_pages = num_seqs * pages_per_seq
    args = _rotary_inputs(rng, num_seqs, heads, kv_heads, head_dim, head_dim, num_pages, page_size)
    args["k_cache"] = _fp8_cache(rng, kv_heads, num_pages, page_size, head_dim, 0.5)
    args["v_cache"] = _fp8_cache(rng, kv_heads, num_pages, page_size, head_dim, 0.25)
    tables = np.arange(num_pages).reshape(num_seqs, pages_per_seq)
    lengths = np.array([5, 16, 1])
    slots = tables[np.arange(num_seqs), (lengths - 1) // page_size] * page_size + (lengths - 1) % page_size
    rest = dict(slot_mapping=jnp.asarray(slots, jnp.int32), block_tables=jnp.asarray(tables, jnp.int32),
                seq_lens=jnp.asarray(lengths, jnp.int32), scale=0.25, k_scale=jnp.float32(0.5),
                v_scale=jnp.float32(0.25))
    want = reference.rotary_paged_decode_attention(**args, **rest)
    got = rotary_paged_decode_attention(**dict(args, k_cache=args["k_cache"] + 0, v_cache=args["v_cache"] + 0),
                                        **rest, interpret=True)
    np.testing.assert_allclose(got[0], want[0], atol=2e-5, rtol=2e-5)
    for cache_got, cache_want in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(np.asarray(cache_got.astype(jnp.float32)),
                                      np.asarray(cache_want.astype(jnp.float32)))


def test_mla_decode_kernel_reads_e4m3_rows_with_their_scale():
    # Two head blocks (the second padded), ragged lengths, splits merged by the combine kernel.
    heads, page_size, lengths, tuning = 20, 4, [9, 1, 20], dict(block_keys=16, num_splits=2)
    rng = np.random.RandomState(3)
    latent_dim, rope_dim = 32, 16
    pages_per_seq = -(-max(lengths) // page_size)
    num_pages = len(lengths) * pages_per_seq + 1
    cache_scale = jnp.float32(0.1)
    cache = fp8.quantize(jnp.asarray(rng.randn(num_pages, page_size, latent_dim + rope_dim), jnp.float32), fp8.FP8,
                         cache_scale)
    q_latent = jnp.asarray(rng.randn(len(lengths), heads, latent_dim), jnp.float32)
    q_rope = jnp.asarray(rng.randn(len(lengths), heads, rope_dim), jnp.float32)
    tables = jnp.asarray(rng.permutation(num_pages)[:len(lengths) * pages_per_seq].reshape(len(lengths), -1),
                         jnp.int32)
    args = (q_latent, q_rope, cache, tables, jnp.asarray(lengths, jnp.int32))
    assert mla_decode.supports(q_latent, q_rope, cache, cache_scale=cache_scale, **tuning)
    assert not mla_decode.supports(q_latent, q_rope, cache, **tuning)  # never an fp8 cache without its scale
    want = mla_reference.mla_paged_decode_attention(*args, scale=0.2, cache_scale=cache_scale)
    got = mla_decode.mla_paged_decode_attention(*args, scale=0.2, cache_scale=cache_scale, interpret=True, **tuning)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_decode_kernel_and_cache_write_lower_for_the_gpu_at_fp8():
    e4m3, bf16, i32, f32 = fp8.FP8, jnp.bfloat16, jnp.int32, jnp.float32
    text = _lower_for_gpu(lambda q, kc, vc, bt, n, ks, vs: paged_decode_attention(q, kc, vc, bt, n, scale=0.1,
                                                                                   k_scale=ks, v_scale=vs),
                          S((4, 32, 128), bf16), S((8, 1024, 16, 128), e4m3), S((8, 1024, 16, 128), e4m3),
                          S((4, 256), i32), S((4,), i32), S((), f32), S((), f32))
    assert "paged_decode_attention" in text
    text = _lower_for_gpu(lambda q, k, v, cos, sin, kc, vc, slots, ks, vs: rotary_cache_write(
                              q, k, v, cos, sin, kc, vc, slots, k_scale=ks, v_scale=vs),
                          S((64, 32, 128), bf16), S((64, 8, 128), bf16), S((64, 8, 128), bf16),
                          S((64, 64), f32), S((64, 64), f32), S((8, 256, 16, 128), e4m3),
                          S((8, 256, 16, 128), e4m3), S((64,), i32), S((), f32), S((), f32))
    assert "rotary_cache_write" in text
    text = _lower_for_gpu(lambda q, r, c, bt, n, cs: mla_decode.mla_paged_decode_attention(q, r, c, bt, n, scale=0.1,
                                                                                           cache_scale=cs),
                          S((2, 128, 512), bf16), S((2, 128, 64), bf16), S((512, 16, 576), e4m3), S((2, 256), i32),
                          S((2,), i32), S((), f32))
    assert "mla_paged_decode_attention" in text


PREFILL_CASES = {  # (cached, new) per sequence, heads, kv_heads, head_dim, page_size, q dtype, options, blocks
    # Ragged runs (a fresh prompt, a continued one, one new token) and padding tokens in small blocks;
    # a group of 3 (padded to 4 in the tile), window, sinks and soft-cap.
    "group3-f32-window-sinks-softcap": ([(0, 9), (5, 4), (12, 1)], 6, 2, 16, 4, jnp.float32,
                                        dict(sliding_window=5, sinks=True, logit_softcap=4.0),
                                        dict(block_q=8, pages_per_block=4)),
    # Pages larger than the key block (virtual pages), q in bf16: tiles converted to bf16.
    "mqa-bf16-split-pages": ([(20, 7), (0, 12)], 4, 1, 32, 32, jnp.bfloat16, {}, dict(block_k=16)),
}


@pytest.mark.parametrize("name", list(PREFILL_CASES))
def test_prefill_kernel_reads_e4m3_pages_with_their_scales(name):
    seqs, heads, kv_heads, head_dim, page_size, dtype, options, blocks = PREFILL_CASES[name]
    q, k_cache, v_cache, md, num_real = make_step(seqs, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                                  page_size=page_size, dtype=jnp.float32, num_pad_tokens=2)
    q = q.astype(dtype)
    k_scale, v_scale = jnp.float32(0.05), jnp.float32(3.0)
    k_cache = fp8.quantize(k_cache * 3.0, fp8.FP8, k_scale)  # stored values up to ~240 (e4m3 max 448)
    v_cache = fp8.quantize(v_cache * 3.0, fp8.FP8, v_scale)
    options = dict(options)
    if options.pop("sinks", False):
        options["sinks"] = jnp.asarray(np.random.RandomState(1).randn(heads), jnp.float32)
    args = (q, k_cache, v_cache, *prefill_ragged(md))
    scale = head_dim ** -0.5
    assert prefill_pallas.supports(*args, scale=scale, k_scale=k_scale, v_scale=v_scale, **options)
    ref = jax.jit(functools.partial(reference.ragged_paged_attention, scale=scale, **options))  # one trace, two calls
    want = ref(*args, k_scale=k_scale, v_scale=v_scale)
    got = prefill_pallas.ragged_paged_attention(*args, scale=scale, k_scale=k_scale, v_scale=v_scale, interpret=True,
                                                **options, **blocks)
    assert got.dtype == q.dtype
    np.testing.assert_array_equal(np.asarray(got[num_real:], np.float32), 0.0)  # padding tokens give zeros
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got[:num_real], np.float32), np.asarray(want[:num_real], np.float32),
                               atol=tol, rtol=tol)
    unscaled = ref(*args, k_scale=jnp.float32(1.0), v_scale=jnp.float32(1.0))
    assert np.abs(np.asarray(unscaled[:num_real], np.float32) - np.asarray(want[:num_real], np.float32)).max() > 0.5


def test_prefill_kernel_refuses_fp8_without_both_scales():
    q, k_cache, v_cache, md, _ = make_step([(0, 5)], heads=2, kv_heads=1, head_dim=16, page_size=4,
                                           dtype=jnp.float32)
    e4m3 = fp8.quantize(k_cache, fp8.FP8, jnp.float32(1.0))
    args = (q, e4m3, e4m3, *prefill_ragged(md))
    one = jnp.float32(1.0)
    assert not prefill_pallas.supports(*args, scale=0.25)
    assert not prefill_pallas.supports(*args, scale=0.25, k_scale=one)
    assert not prefill_pallas.supports(*args, scale=0.25, k_scale=jnp.ones(2), v_scale=one)
    assert not prefill_pallas.supports(q, e4m3, v_cache, *args[3:], scale=0.25, k_scale=one, v_scale=one)
    assert not prefill_pallas.supports(q, k_cache, v_cache, *args[3:], scale=0.25, k_scale=one, v_scale=one)
    with pytest.raises(ValueError, match="an fp8 cache comes with its k_scale and v_scale"):
        prefill_pallas.ragged_paged_attention(*args, scale=0.25, k_scale=one, interpret=True)


SPARSE_CASES = [  # heads, top_k, tuning: two head blocks (the second padded) in one split, or splits merged
    (20, 40, dict(block_keys=16, num_splits=1)),
    (16, 24, dict(block_keys=16, num_splits=2)),
]


@pytest.mark.parametrize("heads, top_k, tuning", SPARSE_CASES)
def test_sparse_mla_kernel_reads_e4m3_rows_with_their_scale(heads, top_k, tuning):
    rng = np.random.RandomState(5)
    tokens, latent_dim, rope_dim, num_pages, page_size = 4, 32, 16, 6, 8
    cache_scale = jnp.float32(0.1)
    cache = fp8.quantize(jnp.asarray(rng.randn(num_pages, page_size, latent_dim + rope_dim) * 3, jnp.float32),
                         fp8.FP8, cache_scale)
    q_latent = jnp.asarray(rng.randn(tokens, heads, latent_dim), jnp.float32)
    q_rope = jnp.asarray(rng.randn(tokens, heads, rope_dim), jnp.float32)
    slots = rng.randint(0, num_pages * page_size, (tokens, top_k)).astype(np.int32)
    slots[1, 7:] = -1  # a short selection
    slots[2] = -1  # none: zeros
    args = (q_latent, q_rope, cache, jnp.asarray(slots))
    assert sparse_attention_pallas.supports(*args, scale=0.2, cache_scale=cache_scale, **tuning)
    assert not sparse_attention_pallas.supports(*args, scale=0.2, **tuning)  # never an fp8 cache without its scale
    ref = jax.jit(functools.partial(sparse_reference.sparse_mla_attention, scale=0.2))
    want = ref(*args, cache_scale=cache_scale)
    got = sparse_attention_pallas.sparse_mla_attention(*args, scale=0.2, cache_scale=cache_scale, interpret=True,
                                                       **tuning)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.asarray(got[2]), 0.0)
    unscaled = ref(*args, cache_scale=jnp.float32(1.0))
    assert np.abs(np.asarray(unscaled) - np.asarray(want)).max() > 0.1


def _scores_by_slot(scores, seq_ids, tables, page_size, num_slots):
    """[T, num_slots]: each token's score of every cache slot (-inf where it has none)."""
    out = np.full((scores.shape[0], num_slots), -np.inf, np.float32)
    for t, seq in enumerate(seq_ids):
        if seq >= 0:
            position = np.arange(scores.shape[1])
            out[t, tables[seq, position // page_size] * page_size + position % page_size] = scores[t]
    return out


def test_indexer_kernel_reads_e4m3_keys_with_their_scale():
    rng = np.random.RandomState(6)
    lengths, heads, width, page_size, top_k = (13, 1, 22), 4, 16, 4, 5
    pages_per_seq = -(-max(lengths) // page_size)
    num_pages = pages_per_seq * len(lengths) + 2
    tables = rng.permutation(num_pages)[:pages_per_seq * len(lengths)].reshape(len(lengths), pages_per_seq)
    positions = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(2, int)]).astype(np.int32)
    seq_ids = np.concatenate([np.full(n, s) for s, n in enumerate(lengths)] + [np.full(2, -1)]).astype(np.int32)
    cache_scale = jnp.float32(0.5)
    cache = fp8.quantize(jnp.asarray(rng.randn(num_pages, page_size, width) * 3, jnp.float32), fp8.FP8, cache_scale)
    q = jnp.asarray(rng.randn(len(positions), heads, width), jnp.float32)
    weights = jnp.asarray(rng.randn(len(positions), heads), jnp.float32)
    args = (q, weights, cache, jnp.asarray(positions), jnp.asarray(seq_ids), jnp.asarray(tables, jnp.int32))
    ref = jax.jit(functools.partial(sparse_reference.indexer_scores, scale=0.25))
    want = np.asarray(ref(*args, cache_scale=cache_scale))
    got = np.asarray(indexer_pallas.indexer_scores(*args, scale=0.25, cache_scale=cache_scale, interpret=True))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-5, atol=1e-5)
    unscaled = np.asarray(ref(*args, cache_scale=jnp.float32(1.0)))
    assert np.abs(unscaled[np.isfinite(want)] - want[np.isfinite(want)]).max() > 0.5

    assert indexer_pallas.supports(*args, scale=0.25, top_k=top_k, cache_scale=cache_scale)
    assert not indexer_pallas.supports(*args, scale=0.25, top_k=top_k)  # never an fp8 cache without its scale
    with registry.targeting(registry.Target.interpreted()), registry.recording() as chosen:
        slots = np.asarray(sparse_ops.indexer_select(*args, scale=0.25, top_k=top_k, cache_scale=cache_scale))
    assert chosen == {"sparse_mla.indexer_select": {"triton"}}
    # The kernel's selection has the reference's best scores (the slots may differ only among ties).
    want_slots = np.asarray(jax.jit(functools.partial(sparse_reference.indexer_select, scale=0.25, top_k=top_k))(
        *args, cache_scale=cache_scale))
    by_slot = _scores_by_slot(want, seq_ids, tables, page_size, num_pages * page_size)
    np.testing.assert_array_equal(slots < 0, want_slots < 0)
    picked = lambda s: np.sort(np.where(s >= 0, np.take_along_axis(by_slot, np.maximum(s, 0), 1), 0), 1)  # noqa: E731
    np.testing.assert_allclose(picked(slots), picked(want_slots), rtol=1e-5, atol=1e-5)


HOPPER = registry.Target(platform="gpu", device_kind="NVIDIA H200", compute_capability="9.0", sm_count=132)
AMPERE = dataclasses.replace(HOPPER, device_kind="NVIDIA A100", compute_capability="8.0", sm_count=108)


@pytest.mark.parametrize("target, prefill, sparse", [
    (registry.Target.interpreted(), "triton", "triton"),
    (HOPPER, "triton", "triton"),  # the Mosaic GPU prefill kernel refuses fp8 caches
    (AMPERE, "reference", "tiled"),  # Triton converts no e4m3 before compute capability 8.9
])
def test_kernels_serve_fp8_caches_where_pallas_reads_e4m3(target, prefill, sparse):
    e4m3, bf16, i32, f32 = fp8.FP8, jnp.bfloat16, jnp.int32, jnp.float32
    one = S((), f32)
    ragged = (S((64,), i32), S((64,), i32), S((2, 8), i32), S((2,), i32))
    cache = S((8, 16, 16, 128), e4m3)
    chosen = attention_ops.ragged_paged_attention_op.choose(target, S((64, 32, 128), bf16), cache, cache, *ragged,
                                                            scale=0.1, k_scale=one, v_scale=one)
    assert chosen.name == prefill
    if target.gpu:  # the same call over a bf16 cache goes to a kernel on any of these GPUs
        bf16_cache = S((8, 16, 16, 128), bf16)
        assert attention_ops.ragged_paged_attention_op.choose(target, S((64, 32, 128), bf16), bf16_cache, bf16_cache,
                                                              *ragged, scale=0.1).name != "reference"
    # DeepSeek-V3.2's decode (one token): an fp8 call is chosen as the bf16 one (the kernel's splits fill the GPU).
    mla = (S((1, 128, 512), bf16), S((1, 128, 64), bf16))
    for cache_dtype, scaled in ((e4m3, dict(cache_scale=one)), (bf16, {})):
        chosen = sparse_ops.sparse_mla_attention_op.choose(target, *mla, S((1024, 64, 576), cache_dtype),
                                                           S((1, 2048), i32), scale=0.1, **scaled)
        assert chosen.name == (sparse if cache_dtype == e4m3 else "triton")
    index = (S((1, 64, 128), bf16), S((1, 64), f32), S((8192, 64, 128), e4m3), S((1,), i32), S((1,), i32),
             S((1, 512), i32))
    chosen = sparse_ops.indexer_select_op.choose(target, *index, scale=0.1, top_k=2048, cache_scale=one)
    assert chosen.name == sparse


def _kernel_takes_e4m3(text: str, name: str) -> bool:
    """Whether the custom call of the kernel named ``name...`` in lowered ``text`` has an e4m3 operand
    (the kernel reads the cache as stored, not a dequantized copy)."""
    calls = [line for line in text.splitlines() if "custom_call" in line and f'name = "{name}' in line]
    return bool(calls) and all("f8E4M3FN" in line.rsplit(" : (", 1)[-1].split(") -> ")[0] for line in calls)


def test_prefill_and_sparse_kernels_lower_for_the_gpu_at_fp8():
    e4m3, bf16, i32, f32 = fp8.FP8, jnp.bfloat16, jnp.int32, jnp.float32
    ragged = (S((512,), i32), S((512,), i32), S((4, 16), i32), S((4,), i32))
    text = _lower_for_gpu(lambda q, kc, vc, pos, ids, bt, n, ks, vs: prefill_pallas.ragged_paged_attention(
                              q, kc, vc, pos, ids, bt, n, scale=0.1, sliding_window=128, k_scale=ks, v_scale=vs),
                          S((512, 32, 128), bf16), S((8, 64, 16, 128), e4m3), S((8, 64, 16, 128), e4m3), *ragged,
                          S((), f32), S((), f32))
    assert _kernel_takes_e4m3(text, "ragged_paged_prefill")
    text = _lower_for_gpu(lambda q, r, c, s, cs: sparse_attention_pallas.sparse_mla_attention(
                              q, r, c, s, scale=0.1, cache_scale=cs, num_splits=16),
                          S((1, 128, 512), bf16), S((1, 128, 64), bf16), S((1024, 64, 576), e4m3), S((1, 2048), i32),
                          S((), f32))
    assert _kernel_takes_e4m3(text, "sparse_mla_attention") and "sparse_mla_combine" in text
    text = _lower_for_gpu(lambda q, w, c, pos, ids, bt, cs: indexer_pallas.indexer_scores(
                              q, w, c, pos, ids, bt, scale=128 ** -0.5, cache_scale=cs),
                          S((1, 64, 128), bf16), S((1, 64), f32), S((8192, 64, 128), e4m3), S((1,), i32),
                          S((1,), i32), S((1, 512), i32), S((), f32))
    assert _kernel_takes_e4m3(text, "indexer_scores")


# ---- models served with an fp8 cache -------------------------------------------------------------

PAGE_SIZE = 8
MODELS = {
    "llama": ("llama", {}),
    "deepseek_v3": ("deepseek_v3", dict(MLA, **MLA_CASES["q-lora-yarn-interleaved-groups"][1])),
}


@pytest.fixture(scope="module", params=list(MODELS))
def tiny_model(request, tmp_path_factory):
    family, overrides = MODELS[request.param]
    path, _ = make_hf_checkpoint(str(tmp_path_factory.mktemp(request.param)), family, **overrides)
    return path, load_model(path, dtype="float32")


_STEPS = {}


def _step(loaded, layout):
    """The jitted model step over ``layout``'s caches, one per model and cache dtype."""
    key = (id(loaded), layout.kv_dtype)
    if key not in _STEPS:
        cache_specs = layout.partition_specs(loaded.plan)
        _STEPS[key] = jax.jit(lambda params, ids, md, caches: loaded.apply(params, ids, md, caches, cache_specs,
                                                                           all_logits=True))
    return _STEPS[key]


def _served_logits(loaded, ids, kv_dtype=None, kv_scales=()):
    """float32 logits of ``ids``: its first tokens in one prefill step, then one decode step per token,
    over a cache laid out with ``kv_dtype`` -> (logits [len(ids), vocab], the caches)."""
    specs = loaded.model_cls.cache_specs(loaded.config)
    pages = -(-len(ids) // PAGE_SIZE)
    layout = CacheLayout(specs, PAGE_SIZE, pages, jnp.float32, kv_dtype=kv_dtype, kv_scales=kv_scales)
    caches, step = layout.zeros(), _step(loaded, layout)
    tables = np.arange(pages, dtype=np.int32)[None]
    prefill = len(ids) - 3
    md = build_metadata([0], [prefill], tables, page_size=PAGE_SIZE, num_tokens=prefill)
    logits, caches = step(loaded.params, jnp.asarray(ids[:prefill], jnp.int32), md, caches)
    rows = [np.asarray(logits)]
    for position in range(prefill, len(ids)):
        md = build_metadata([position], [1], tables, page_size=PAGE_SIZE, num_tokens=1, decode=True)
        logits, caches = step(loaded.params, jnp.asarray(ids[position:position + 1], jnp.int32), md, caches)
        rows.append(np.asarray(logits))
    return np.concatenate(rows), caches


def test_fp8_cache_logits_stay_within_e4m3_error(tiny_model):
    path, loaded = tiny_model
    ids = random_prompts([13], seed=3)[0]
    want, _ = _served_logits(loaded, ids)
    got, caches = _served_logits(loaded, ids, fp8.FP8)
    scaled, scaled_caches = _served_logits(
        loaded, ids, fp8.FP8, tuple(tuple((name, 2.0) for name in layer if name.endswith("_scale"))
                                    for layer in caches))
    first = caches[0]
    paged = "k" if "k" in first else "latent"
    assert first[paged].dtype == fp8.FP8
    stored, stored_scaled = (np.asarray(c[0][paged].astype(jnp.float32)) for c in (caches, scaled_caches))
    assert not np.array_equal(stored, stored_scaled)  # a scale of 2 stores other values
    span = np.abs(want).max()
    for logits in (got, scaled):
        error = np.abs(logits - want).max()
        # Measured on CPU: 0.5-2% of the logits' span; a cache that skipped e4m3 would give ~1e-6, one that
        # lost its scale (read back 2x off) far more.
        assert 1e-4 * span < error < 0.05 * span, (error, span)


def _greedy(loaded, prompt, max_tokens, kv_dtype=None):
    """Greedy tokens after ``prompt`` over a cache laid out with ``kv_dtype``: a prefill step, then
    decode steps."""
    specs = loaded.model_cls.cache_specs(loaded.config)
    pages = -(-(len(prompt) + max_tokens) // PAGE_SIZE)
    layout = CacheLayout(specs, PAGE_SIZE, pages, jnp.float32, kv_dtype=kv_dtype)
    caches, step = layout.zeros(), _step(loaded, layout)
    tables = np.arange(pages, dtype=np.int32)[None]
    md = build_metadata([0], [len(prompt)], tables, page_size=PAGE_SIZE, num_tokens=len(prompt))
    logits, caches = step(loaded.params, jnp.asarray(prompt, jnp.int32), md, caches)
    tokens = [int(np.argmax(logits[-1]))]
    while len(tokens) < max_tokens:
        md = build_metadata([len(prompt) + len(tokens) - 1], [1], tables, page_size=PAGE_SIZE, num_tokens=1,
                            decode=True)
        logits, caches = step(loaded.params, jnp.asarray(tokens[-1:], jnp.int32), md, caches)
        tokens.append(int(np.argmax(logits[-1])))
    return tokens


def test_fp8_cache_greedy_tokens_match(tiny_model):
    _, loaded = tiny_model
    prompt = random_prompts([10], seed=4)[0]  # the shapes of the logits test: its programs again
    assert _greedy(loaded, prompt, 5, fp8.FP8) == _greedy(loaded, prompt, 5)


@pytest.mark.parametrize("tiny_model", ["llama"], indirect=True)  # the engine's plumbing; the ops are tested above
def test_engine_serves_an_fp8_cache(tiny_model):
    path, loaded = tiny_model
    prompt = random_prompts([10], seed=4)[0]
    llm = LLM(path, dtype="float32", max_model_len=32, max_num_seqs=1, max_num_batched_tokens=16, page_size=PAGE_SIZE,
              show_progress=False, warmup=False, kv_cache_dtype="fp8")
    caches = llm.engine.runner.caches[0]
    assert caches["latent" if "latent" in caches else "k"].dtype == fp8.FP8
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=5,
                                                                                  ignore_eos=True))
    assert out[0].token_ids == _greedy(loaded, prompt, 5)


# ---- the checkpoint's scales ----------------------------------------------------------------------

def _with_tensors(path, tensors: dict, drop=()):
    file = f"{path}/model.safetensors"
    stored = {name: value for name, value in load_file(file).items() if name not in drop}
    save_file({**stored, **tensors}, file, metadata={"format": "pt"})


def test_checkpoint_k_and_v_scales_are_read(tmp_path):
    path, _ = make_hf_checkpoint(str(tmp_path / "llama"), "llama")
    _with_tensors(path, {"model.layers.0.self_attn.k_scale": np.asarray(0.25, np.float32),
                         "model.layers.1.self_attn.v_proj.v_scale": np.asarray([4.0], np.float32)})
    loaded = load_model(path, dtype="float32")
    assert loaded.kv_scales == ((("k_scale", 0.25),), (("v_scale", 4.0),))


@pytest.mark.parametrize("value, match", [
    (np.asarray(np.nan, np.float32), "must be a finite positive"),
    (np.asarray(-1.0, np.float32), "must be a finite positive"),
    (np.asarray(0.0, np.float32), "must be a finite positive"),
    (np.ones(2, np.float32), "must be a scalar"),
])
def test_a_bad_checkpoint_scale_is_a_checkpoint_error(tmp_path, value, match):
    path, _ = make_hf_checkpoint(str(tmp_path / "llama"), "llama", num_hidden_layers=1)
    _with_tensors(path, {"model.layers.0.self_attn.k_scale": value})
    checkpoint = SafetensorsCheckpoint(path)
    with pytest.raises(CheckpointError, match=f"model.layers.0.self_attn.k_scale {match}"):
        read_kv_scales(checkpoint, ((PagedKV(2, 16),),))
