"""fp8 weights in the projection ops: the few-row kernel reading fp8 weights and the fp8 x fp8 GEMM
(interpret mode, CPU) against their references, the choices the registry makes for them, their GPU
lowering, and a tiny fp8 Llama decoding through the fp8 kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxinfer.errors import KernelNotSupportedError
from jaxinfer.kernels import linear as linear_ops
from jaxinfer.kernels import registry
from jaxinfer.kernels.linear import fp8, fp8_gemm_pallas, reference, skinny_pallas
from jaxinfer.quantization import Fp8Weight
from tests.test_kernel_lowering import _lower_for_gpu

S = jax.ShapeDtypeStruct
BF16, F8 = jnp.bfloat16, jnp.float8_e4m3fn


def fp8_weight(rng, out_features: int, in_features: int, block) -> Fp8Weight:
    """A random weight quantized as checkpoints store it: a scale of max |w| / 448 per ``block``
    (the last ones ragged), or one for the tensor (None)."""
    w = rng.randn(out_features, in_features).astype(np.float32) * in_features**-0.5
    if block is None:
        scales = np.full((1, 1), np.abs(w).max() / 448, np.float32)
        expanded = scales
    else:
        rows, cols = -(-out_features // block[0]), -(-in_features // block[1])
        padded = np.zeros((rows * block[0], cols * block[1]), np.float32)
        padded[:out_features, :in_features] = np.abs(w)
        scales = padded.reshape(rows, block[0], cols, block[1]).max(axis=(1, 3)) / 448
        expanded = np.repeat(np.repeat(scales, block[0], 0), block[1], 1)[:out_features, :in_features]
    return Fp8Weight(jnp.asarray(w / expanded, F8), jnp.asarray(scales), block)


def _f32(a):
    return np.asarray(a, np.float32)


def _assert_close(got, want, dtype):
    # float32: the order of the sums; bf16: the outputs may round one unit apart.
    tol = 1e-5 if dtype == jnp.float32 else 2**-7
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype == dtype
        np.testing.assert_allclose(_f32(g), _f32(w), rtol=tol, atol=tol)


def _mixed_case(rows, dtype, block, seed=0):
    """x [rows, 200], and one call's weights: block-scaled (50 rows: a ragged last row block; 200
    columns: a ragged last column block), plain with a bias, one scale per tensor with a float32 bias."""
    rng = np.random.RandomState(seed)
    x = jnp.asarray(rng.randn(rows, 200), dtype)
    weights = [fp8_weight(rng, 50, 200, block), jnp.asarray(rng.randn(20, 200) * 200**-0.5, dtype),
               fp8_weight(rng, 7, 200, None)]
    biases = [None, jnp.asarray(rng.randn(20), dtype), jnp.asarray(rng.randn(7), jnp.float32)]
    return x, weights, biases


# ---- the few-row kernel reading fp8 weights ------------------------------------------------------

@pytest.mark.parametrize("rows, dtype, block", [  # one row: elementwise; 3 rows: the tensor-core dot
    (1, jnp.float32, (24, 48)), (3, BF16, (24, 48)),  # reduction tiles of 16 columns
    (1, BF16, (16, 32)),  # of 32
])
def test_skinny_fp8_matches_reference(rows, dtype, block):
    x, weights, biases = _mixed_case(rows, dtype, block)
    _assert_close(skinny_pallas.project(x, weights, biases, interpret=True), reference.project(x, weights, biases),
                  dtype)


def test_skinny_fp8_with_a_given_blocking():
    """Tiles narrower than the block (two per column block of 64) and a one-row tile of 8 weight rows."""
    x, weights, biases = _mixed_case(1, jnp.float32, (24, 64), seed=1)
    got = skinny_pallas.project(x, weights, biases, blocking=skinny_pallas.Blocking(8, 32, 4, 2), interpret=True)
    _assert_close(got, reference.project(x, weights, biases), jnp.float32)


def test_norm_project_fp8_matches_reference():
    dtype = BF16
    x, weights, biases = _mixed_case(1, dtype, (24, 48), seed=2)
    x = x * 3.0 + 0.5
    g = jnp.asarray(np.random.RandomState(4).uniform(0.5, 1.5, 200), dtype)
    got = skinny_pallas.norm_project(x, g, weights, biases, eps=1e-6, interpret=True)
    # The kernel never rounds the normalised row (see test_linear_kernel): the oracle is the float32
    # reference on the weights the reference dequantizes to x's dtype.
    dense = [fp8.dense(w, dtype).astype(jnp.float32) for w in weights]
    want, _ = reference.norm_project(x.astype(jnp.float32), None, g.astype(jnp.float32), dense,
                                     [None if b is None else b.astype(dtype).astype(jnp.float32) for b in biases],
                                     eps=1e-6)
    tol = 1e-5 if dtype == jnp.float32 else 2**-7
    for got_out, want_out in zip(got, want):
        assert got_out.dtype == dtype
        np.testing.assert_allclose(_f32(got_out), _f32(want_out), rtol=tol, atol=tol)


def test_ops_choose_the_fp8_kernel_where_it_takes_the_call():
    """Interpreted: a lone fp8 weight (where a plain one would run XLA's matmul) goes to the few-row
    kernel at 1 and 16 rows, and with the norm at one row; more rows, and blocks too narrow to tile
    (28 columns: a power-of-two factor of 4), run the reference."""
    rng = np.random.RandomState(5)
    w, narrow = fp8_weight(rng, 24, 64, (16, 32)), fp8_weight(rng, 24, 64, (16, 28))
    cases = [(1, [w], "skinny"), (16, [w], "skinny"), (17, [w], "reference"), (1, [narrow], "reference")]
    with registry.targeting(registry.Target.interpreted()):
        for rows, weights, expected in cases:
            x = jnp.asarray(rng.randn(rows, 64), jnp.float32)
            with registry.recording() as chosen:
                got = linear_ops.project(x, weights)
            assert chosen == {"linear.project": {expected}}, (rows, chosen)
            np.testing.assert_allclose(_f32(got[0]), _f32(reference.project(x, weights)[0]), rtol=1e-5, atol=1e-5)
        with registry.recording() as chosen:
            linear_ops.norm_project(jnp.ones((1, 64)), None, jnp.ones(64), [w], eps=1e-6)
        assert chosen == {"linear.norm_project": {"skinny"}}
        with registry.force("linear.project", "skinny"), pytest.raises(KernelNotSupportedError):
            linear_ops.project(jnp.ones((1, 64)), [narrow])
    # A GPU whose Triton does not convert e4m3 (before compute capability 8.9) leaves fp8 weights to
    # the reference, and plain ones to the kernel.
    skinny = linear_ops.project_op.implementations["skinny"]
    x, plain = jnp.ones((1, 64)), jnp.ones((24, 64))
    for capability, fp8_taken in (("8.0", False), ("8.9", True), ("9.0", True)):
        target = registry.Target(platform="gpu", compute_capability=capability)
        assert skinny.supports(target, x, (w,), None) is fp8_taken, capability
        assert skinny.supports(target, x, (plain,), None)


def test_bad_fp8_weights_are_refused():
    rng = np.random.RandomState(6)
    w = fp8_weight(rng, 24, 64, (16, 32))
    x = jnp.ones((1, 64))
    with pytest.raises(ValueError, match=r"fp8 weight 0 \[24, 64\] in blocks of \(16, 32\) needs scales \[2, 2\]"):
        linear_ops.project(x, [Fp8Weight(w.values, w.scales[:, :1], w.block)])
    with pytest.raises(ValueError, match="fp8 weight 1 holds bfloat16 values"):
        linear_ops.project(x, [w, Fp8Weight(w.values.astype(BF16), w.scales, w.block)])
    with pytest.raises(ValueError, match="float32"):
        linear_ops.project(x, [Fp8Weight(w.values, w.scales.astype(BF16), w.block)])
    with pytest.raises(ValueError, match=r"block_k \(64\) must divide fp8 weight 0's column block \(32\)"):
        skinny_pallas.project(x, [w], blocking=skinny_pallas.Blocking(4, 64, 4, 3), interpret=True)
    with pytest.raises(ValueError, match="power-of-two factor"):
        skinny_pallas.project(x, [fp8_weight(rng, 24, 64, (16, 28))], interpret=True)


# ---- the fp8 x fp8 GEMM --------------------------------------------------------------------------

def _gemm_in_float64(x, weight: Fp8Weight) -> np.ndarray:
    """The GEMM's math written out in numpy: x quantized per row and group with ml_dtypes' e4m3, then
    every group's products summed in float64 and scaled."""
    x = np.asarray(x, np.float64)
    k = x.shape[1]
    group = weight.block[1] if weight.block else k
    values = np.asarray(weight.values.astype(jnp.float32), np.float64)
    scales = np.asarray(weight.scales, np.float64)
    out = np.zeros((x.shape[0], values.shape[0]))
    for g, k0 in enumerate(range(0, k, group)):
        xg = x[:, k0:k0 + group]
        x_scale = np.maximum(np.abs(xg).max(axis=1, keepdims=True), 1e-10) / 448
        xq = (xg / x_scale).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        w_scale = (np.repeat(scales[:, g], weight.block[0])[:values.shape[0]] if weight.block
                   else np.full(values.shape[0], scales[0, 0]))
        out += (xq @ values[:, k0:k0 + group].T) * x_scale * w_scale[None, :]
    return out


@pytest.mark.parametrize("block", [(24, 64), None])
def test_fp8_gemm_reference_is_the_quantized_math(block):
    rng = np.random.RandomState(7)
    x = rng.randn(20, 200).astype(np.float32)
    weight = fp8_weight(rng, 50, 200, block)
    got = reference.fp8_gemm(jnp.asarray(x), weight)
    np.testing.assert_allclose(_f32(got), _gemm_in_float64(x, weight), rtol=1e-5, atol=1e-5)
    # and within the activations' quantization error of the model's projection
    dense = _f32(reference.project(jnp.asarray(x), [weight])[0])
    assert np.abs(_f32(got) - dense).max() < 0.05 * np.abs(dense).max()


@pytest.mark.parametrize("rows, dtype, block, blocking", [
    (20, jnp.float32, (24, 64), None),           # ragged row, column and reduction tiles
    (20, BF16, (24, 64), fp8_gemm_pallas.Blocking(16, 16, 32, 4, 2)),  # two reduction tiles per group
    (5, BF16, None, None),                      # one scale per tensor: one activation scale per token
])
def test_fp8_gemm_kernel_matches_reference(rows, dtype, block, blocking):
    rng = np.random.RandomState(8)
    x = jnp.asarray(rng.randn(rows, 200), dtype)
    weight = fp8_weight(rng, 50, 200, block)
    bias = jnp.asarray(rng.randn(50), dtype)
    got = fp8_gemm_pallas.fp8_gemm(x, weight, bias, blocking=blocking, interpret=True)
    _assert_close([got], [reference.fp8_gemm(x, weight, bias)], dtype)


def test_fp8_gemm_refuses_what_it_cannot_tile():
    rng = np.random.RandomState(9)
    x = jnp.ones((4, 64))
    assert not fp8_gemm_pallas.takes(fp8_weight(rng, 24, 64, (16, 16))) and not fp8_gemm_pallas.takes(jnp.ones((2, 2)))
    with pytest.raises(ValueError, match="power-of-two factor of at least 32"):
        fp8_gemm_pallas.fp8_gemm(x, fp8_weight(rng, 24, 64, (16, 48)), interpret=True)
    with pytest.raises(ValueError, match=r"block_k \(64\) must divide the weight's column block \(32\)"):
        fp8_gemm_pallas.fp8_gemm(x, fp8_weight(rng, 24, 64, (16, 32)), interpret=True,
                                 blocking=fp8_gemm_pallas.Blocking(16, 16, 64, 4, 2))
    with pytest.raises(ValueError, match="takes an Fp8Weight"):
        linear_ops.fp8_gemm(x, jnp.ones((24, 64)))


def test_quantized_activations_route_fp8_weights_at_prefill_to_the_gemm():
    """Inside ``quantized_activations()``: at 20 rows the fp8 weight goes through ``fp8_gemm`` (here its
    kernel, forced) and the plain one as ``project`` serves it; at one row nothing changes."""
    rng = np.random.RandomState(10)
    w, plain = fp8_weight(rng, 24, 64, (16, 32)), jnp.asarray(rng.randn(8, 64), jnp.float32)
    x = jnp.asarray(rng.randn(20, 64), jnp.float32)
    with registry.targeting(registry.Target.interpreted()), registry.force("linear.fp8_gemm", "triton"), \
            linear_ops.quantized_activations():
        with registry.recording() as chosen:
            got_fp8, got_plain = linear_ops.project(x, [w, plain])
        assert chosen == {"linear.project": {"variant", "reference"}, "linear.fp8_gemm": {"triton"}}
        with registry.recording() as chosen:
            linear_ops.project(x[:1], [w, plain])
        assert chosen == {"linear.project": {"variant", "skinny"}}
    np.testing.assert_allclose(_f32(got_fp8), _f32(reference.fp8_gemm(x, w)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_f32(got_plain), _f32(x @ plain.T), rtol=1e-5, atol=1e-5)


# ---- lowering for the GPU ------------------------------------------------------------------------

def _kernel_operands(text: str) -> str:
    """The operand types of the lowered module's Triton kernel calls."""
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @__gpu$xla.gpu.triton" in line]
    assert calls, "no Triton kernel in the lowered module"
    return " ".join(line[line.rindex(" : (") + 4:line.rindex(") -> ")] for line in calls)


def _abstract_fp8(out_features, in_features, block):
    scales = (1, 1) if block is None else (-(-out_features // block[0]), -(-in_features // block[1]))
    return Fp8Weight(S((out_features, in_features), F8), S(scales, jnp.float32), block)


@pytest.mark.parametrize("rows, weights", [
    (1, ((4096, 4096, (128, 128)), (1024, 4096, (128, 128)), (1024, 4096, None))),  # Llama-3-8B q/k/v
    (8, ((2880, 4096, (128, 128)), (512, 4096, "bf16"))),                           # mixed, ragged rows
])
def test_skinny_fp8_lowers(rows, weights):
    ws = tuple(S((n, k), BF16) if block == "bf16" else _abstract_fp8(n, k, block) for n, k, block in weights)
    text = _lower_for_gpu(lambda x, w: skinny_pallas.project(x, w), S((rows, 4096), BF16), ws)
    assert "project_block_n" in text
    operands = _kernel_operands(text)  # the kernel reads the fp8 values themselves, not a dequantized copy
    for n, k, block in weights:
        assert f"tensor<{n}x{k}x{'bf16' if block == 'bf16' else 'f8E4M3FN'}>" in operands


def test_norm_project_fp8_lowers():
    ws = (_abstract_fp8(14336, 4096, (128, 128)), _abstract_fp8(14336, 4096, (128, 128)))
    text = _lower_for_gpu(lambda x, g, w: skinny_pallas.norm_project(x, g, w, eps=1e-5), S((1, 4096), BF16),
                          S((4096,), BF16), ws)
    assert "norm_project_block_n" in text and "tensor<14336x4096xf8E4M3FN>" in _kernel_operands(text)


@pytest.mark.parametrize("rows, out_features, in_features, block", [
    (8192, 14336, 4096, (128, 128)),  # Llama-3-8B gate/up at a long prefill
    (1000, 2880, 4096, (128, 128)),   # ragged rows and columns
    (300, 4096, 4096, None),          # one scale per tensor
])
def test_fp8_gemm_lowers(rows, out_features, in_features, block):
    text = _lower_for_gpu(lambda x, w: fp8_gemm_pallas.fp8_gemm(x, w), S((rows, in_features), BF16),
                          _abstract_fp8(out_features, in_features, block))
    assert "fp8_gemm_block_m" in text
    operands = _kernel_operands(text)  # e4m3 activations and weights
    assert f"tensor<{rows}x{in_features}xf8E4M3FN>" in operands
    assert f"tensor<{out_features}x{in_features}xf8E4M3FN>" in operands


# ---- a whole model -------------------------------------------------------------------------------

def test_fp8_llama_decodes_through_the_fp8_kernel(tmp_path):
    """A one-layer tiny Llama with fp8 weights in blocks of 24 x 48 (ragged at every width but 96)
    decodes through the few-row kernel reading fp8 (interpreted; the norm and q/k/v or gate/up in
    one launch) with the greedy tokens of its dequantized weights (HF's model on them, which
    ``quantization=None`` matches: tests/test_fp8.py). The 20-token prompt runs the reference."""
    from jaxinfer import LLM, SamplingParams
    from tests.conftest import assert_same_greedy_tokens, hf_greedy, hf_next_logits, random_prompts
    from tests.test_fp8 import write_fp8_checkpoint

    path, hf_model = write_fp8_checkpoint(tmp_path / "ckpt", "llama", block=(24, 48), num_hidden_layers=1)
    prompts = random_prompts([20], seed=2)
    llm_options = dict(dtype="float32", max_model_len=32, max_num_seqs=1, max_num_batched_tokens=32, page_size=8,
                       warmup=False, show_progress=False)
    # Only the projections interpreted: the other kernels run whole models in test_models_on_kernels.
    reference_elsewhere = registry.force({"attention": "reference", "norm": "reference"})
    with registry.targeting(registry.Target.interpreted()), reference_elsewhere, registry.recording() as chosen:
        got = LLM(path, **llm_options).generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
            temperature=0, max_tokens=5, ignore_eos=True))
    assert "skinny" in chosen["linear.project"] and "skinny" in chosen["linear.norm_project"]
    assert_same_greedy_tokens([o.token_ids for o in got], [hf_greedy(hf_model, p, 5) for p in prompts], prompts,
                              hf_next_logits(hf_model))
