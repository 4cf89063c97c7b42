"""Quantized experts: the grouped MoE kernels reading fp8 (block and per-tensor scales) and MXFP4
weights as stored (interpret mode, CPU) against the reference, which dequantizes; their lowering for
the GPU; and GPT-OSS's MXFP4 experts kept in 4 bits on the device, one device and split over two."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from safetensors.numpy import load_file, save_file

from jaxinfer import load_model
from jaxinfer.errors import CheckpointError
from jaxinfer.kernels import moe as moe_ops
from jaxinfer.kernels import registry
from jaxinfer.kernels.moe import grouped_pallas, reference
from jaxinfer.quantization import Fp8Weight, Mxfp4Tensor, Mxfp4Weight, dequantize_mxfp4
from jaxinfer.tiny import tiny_config
from jaxinfer.weights import SafetensorsCheckpoint
from tests.conftest import assert_same_greedy_tokens, random_prompts
from tests.test_kernel_lowering import _lower_for_gpu

S = jax.ShapeDtypeStruct
BF16, I32 = jnp.bfloat16, jnp.int32


def fp8_experts(rng, experts, rows, cols, block):
    """Random e4m3 values with float32 scales per ``block`` (None: one per expert)."""
    values = jnp.asarray(rng.randn(experts, rows, cols) * 2, jnp.float8_e4m3fn)
    shape = (experts, 1, 1) if block is None else (experts, -(-rows // block[0]), -(-cols // block[1]))
    return Fp8Weight(values, jnp.asarray(rng.uniform(0.02, 0.2, shape), jnp.float32), block)


def mxfp4_experts(rng, experts, rows, cols):
    """Random MXFP4 bytes with exponents around 2 ** -4."""
    blocks = rng.randint(0, 256, size=(experts, rows, cols // 32, 16)).astype(np.uint8)
    scales = rng.randint(120, 127, size=(experts, rows, cols // 32)).astype(np.uint8)
    return Mxfp4Weight(jnp.asarray(blocks), jnp.asarray(scales))


def dense(rng, experts, rows, cols):
    return jnp.asarray(rng.randn(experts, rows, cols) * cols**-0.5, jnp.float32)


def fp8_block(block):
    return lambda rng, e, n, k: fp8_experts(rng, e, n, k, block)


CASES = {
    # name: (T, k, E, H, I, dtype, gate/up maker, down maker, kernel options)
    # 24 x 32 blocks: ragged last blocks along both dimensions of every weight (H 80, I 48); several
    # row blocks per expert (the grouping kernels), K steps of 16 inside the 32-wide blocks, output
    # columns in blocks of 32 (the last one masked, and its rows' scales).
    "fp8-block-ragged": (40, 2, 4, 80, 48, jnp.float32, fp8_block((24, 32)), fp8_block((24, 32)),
                         dict(block_m=16, block_n=32, block_k=16)),
    "fp8-tensor-bf16": (5, 2, 4, 80, 48, jnp.bfloat16, fp8_block(None), fp8_block(None), {}),
    # H 96 in K steps and output blocks of 64: gate and up's last K step and down's last columns masked.
    "mxfp4-masked": (40, 2, 4, 96, 64, jnp.float32, mxfp4_experts, mxfp4_experts,
                     dict(block_m=16, block_n=64, block_k=64)),
    # Down dequantized on load (as where a split cuts its groups), gate and up kept.
    "mxfp4-one-token-plain-down": (1, 2, 4, 96, 64, jnp.float32, mxfp4_experts, dense, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_kernel_reads_quantized_experts(case):
    t, k, e, h, i, dtype, gate_up_kind, down_kind, options = CASES[case]
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(t, h), dtype)
    ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), I32)
    weights = jnp.asarray(rng.rand(t, k), dtype)
    gate, up, down = gate_up_kind(rng, e, i, h), gate_up_kind(rng, e, i, h), down_kind(rng, e, h, i)
    want = np.asarray(reference.moe_mlp(x, ids, weights, gate, up, down, activation="gpt_oss"), np.float32)
    got = grouped_pallas.moe_mlp(x, ids, weights, gate, up, down, activation="gpt_oss", interpret=True, **options)
    assert got.dtype == dtype
    scale = np.abs(want).max()
    assert scale > 0.1
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol * scale)


def test_mxfp4_reference_dequantizes_as_the_loader_does():
    rng = np.random.RandomState(1)
    weight = mxfp4_experts(rng, 2, 3, 64)
    want = dequantize_mxfp4(np.asarray(weight.blocks), np.asarray(weight.scales))
    np.testing.assert_array_equal(np.asarray(weight.dequantize(jnp.float32)), want)
    assert weight.shape == (2, 3, 64)


def test_mxfp4_tensors_read_as_slices_of_their_rows_and_bad_groups_are_refused(tmp_path):
    """A fused tensor's odd rows (GPT-OSS's up), a slice cutting groups at both ends, as the loader
    dequantizes it; an exponent of 255 (NaN) and mismatched scales are refused by name."""
    rng = np.random.RandomState(3)
    weight = mxfp4_experts(rng, 2, 6, 96)
    blocks, scales = np.asarray(weight.blocks), np.asarray(weight.scales)
    bad = scales.copy()
    bad[1, 5, 2] = 255
    save_file({"w_blocks": blocks, "w_scales": scales, "nan_blocks": blocks, "nan_scales": bad,
               "odd_blocks": blocks, "odd_scales": scales[:, :, :2]}, str(tmp_path / "model.safetensors"))
    checkpoint = SafetensorsCheckpoint(tmp_path)
    up = Mxfp4Tensor("w_blocks", "w_scales", rows=slice(1, None, 2))
    assert up.shape(checkpoint) == (2, 3, 96)
    want = dequantize_mxfp4(blocks, scales)[:, 1::2]
    np.testing.assert_array_equal(up.read(checkpoint, (slice(0, 2), slice(1, 3), slice(20, 70))),
                                  want[:, 1:3, 20:70])
    with pytest.raises(CheckpointError, match="nan_blocks: MXFP4 groups whose scale makes them infinite or NaN"):
        Mxfp4Tensor("nan_blocks", "nan_scales").read(checkpoint, None)
    with pytest.raises(CheckpointError, match="odd_scales"):
        Mxfp4Tensor("odd_blocks", "odd_scales").shape(checkpoint)


def test_what_the_tiling_cannot_take_is_refused():
    rng = np.random.RandomState(2)
    x, ids, weights = jnp.ones((2, 64)), jnp.zeros((2, 1), I32), jnp.ones((2, 1))
    narrow = fp8_experts(rng, 2, 32, 64, (16, 24))  # 24 columns: no K step of 16 or more fits
    plain = dense(rng, 2, 32, 64)
    fp8 = fp8_experts(rng, 2, 32, 64, (16, 32))
    down = fp8_experts(rng, 2, 64, 32, (16, 32))
    mx_gate, mx_down = mxfp4_experts(rng, 2, 32, 64), mxfp4_experts(rng, 2, 64, 32)
    interpreted = registry.Target.interpreted()
    for args, options, message in [
        ((narrow, narrow, down), {}, "scale block 24 wide"),
        ((fp8, fp8, Fp8Weight(down.values, down.scales[:, :2], (16, 32))), {}, r"down: fp8 scales \(2, 2, 1\)"),
        ((fp8, plain, down), {}, "must be stored alike"),
        ((fp8, fp8, down), dict(block_k=64), "must divide the fp8 scale block's width 32"),
        ((mx_gate, mx_gate, mx_down), dict(block_k=16), "multiple of the MXFP4 group"),
    ]:
        assert not moe_ops.moe_mlp_op.implementations["grouped"].supports(interpreted, x, ids, weights, *args,
                                                                          **options)
        with pytest.raises(ValueError, match=message):
            grouped_pallas.moe_mlp(x, ids, weights, *args, interpret=True, **options)
    for args in ((fp8, fp8, down), (mx_gate, mx_gate, mx_down)):
        assert moe_ops.moe_mlp_op.choose(interpreted, x, ids, weights, *args).name == "grouped"
    # Triton converts e4m3 from compute capability 8.9: an A100 dequantizes in the reference.
    a100 = registry.Target(platform="gpu", compute_capability="8.0")
    hopper = registry.Target(platform="gpu", compute_capability="9.0")
    assert moe_ops.moe_mlp_op.choose(a100, x, ids, weights, fp8, fp8, down).name == "reference"
    assert moe_ops.moe_mlp_op.choose(a100, x, ids, weights, mx_gate, mx_gate, mx_down).name == "grouped"
    assert moe_ops.moe_mlp_op.choose(hopper, x, ids, weights, fp8, fp8, down).name == "grouped"


def _abstract_fp8(e, n, k, block):
    scales = (e, 1, 1) if block is None else (e, -(-n // block[0]), -(-k // block[1]))
    return Fp8Weight(S((e, n, k), jnp.float8_e4m3fn), S(scales, jnp.float32), block)


def _abstract_mxfp4(e, n, k):
    return Mxfp4Weight(S((e, n, k // 32, 16), jnp.uint8), S((e, n, k // 32), jnp.uint8))


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, kind", [
    (1, 128, 8, 2048, 768, "fp8-block"), (4096, 128, 8, 2048, 768, "fp8-block"),  # Qwen3-30B-A3B FP8
    (32, 128, 8, 2048, 768, "fp8-tensor"),
    (1, 32, 4, 2880, 2880, "mxfp4"), (4096, 32, 4, 2880, 2880, "mxfp4"),  # GPT-OSS-20B
])
def test_quantized_grouped_kernels_lower(tokens, experts, top_k, hidden, inter, kind):
    make = {"fp8-block": functools.partial(_abstract_fp8, block=(128, 128)),
            "fp8-tensor": functools.partial(_abstract_fp8, block=None), "mxfp4": _abstract_mxfp4}[kind]
    text = _lower_for_gpu(functools.partial(grouped_pallas.moe_mlp, activation="gpt_oss"), S((tokens, hidden), BF16),
                          S((tokens, top_k), I32), S((tokens, top_k), BF16), make(experts, inter, hidden),
                          make(experts, inter, hidden), make(experts, hidden, inter))
    assert "moe_gate_up" in text and "moe_down" in text
    # The kernels take the weights as stored: no dequantized copy of the experts is made before them.
    stored = "f8E4M3FN" if kind.startswith("fp8") else "ui8"
    assert f"tensor<{experts}x{inter}x{hidden // (2 if kind == 'mxfp4' else 1)}x{stored}>" in text
    assert f"tensor<{experts}x{inter}x{hidden}xbf16>" not in text


# ---- GPT-OSS with MXFP4 experts -----------------------------------------------------------------

def write_mxfp4_gpt_oss(path) -> str:
    """A tiny random GPT-OSS checkpoint (1 layer, 8 experts of width 96, hidden 64) in the hub's
    layout, its experts stored in MXFP4, written straight from numpy."""
    config = tiny_config("gpt_oss", vocab_size=160, intermediate_size=96, num_hidden_layers=1,
                         layer_types=["sliding_attention"])
    vocab, hidden, heads, kv_heads, head_dim = 160, 64, 4, 2, 16
    experts, inter = config["num_local_experts"], config["intermediate_size"]
    rng = np.random.RandomState(0)
    normal = lambda *shape: (0.1 * rng.randn(*shape)).astype(np.float32)  # noqa: E731
    tensors = {"model.embed_tokens.weight": normal(vocab, hidden), "lm_head.weight": normal(vocab, hidden),
               "model.norm.weight": 1 + normal(hidden)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        for name, rows in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim),
                           ("v_proj", kv_heads * head_dim)):
            tensors[f"{prefix}.self_attn.{name}.weight"] = normal(rows, hidden)
            tensors[f"{prefix}.self_attn.{name}.bias"] = normal(rows)
        tensors.update({f"{prefix}.self_attn.o_proj.weight": normal(hidden, heads * head_dim),
                        f"{prefix}.self_attn.o_proj.bias": normal(hidden), f"{prefix}.self_attn.sinks": normal(heads),
                        f"{prefix}.input_layernorm.weight": 1 + normal(hidden),
                        f"{prefix}.post_attention_layernorm.weight": 1 + normal(hidden),
                        f"{prefix}.mlp.router.weight": normal(experts, hidden),
                        f"{prefix}.mlp.router.bias": normal(experts),
                        f"{prefix}.mlp.experts.gate_up_proj_bias": normal(experts, 2 * inter),
                        f"{prefix}.mlp.experts.down_proj_bias": normal(experts, hidden)})
        for name, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
            weight = mxfp4_experts(rng, experts, rows, cols)
            tensors[f"{prefix}.mlp.experts.{name}_blocks"] = np.asarray(weight.blocks)
            tensors[f"{prefix}.mlp.experts.{name}_scales"] = np.asarray(weight.scales)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": {"quant_method": "mxfp4"}}, f)
    return str(path)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    return write_mxfp4_gpt_oss(tmp_path_factory.mktemp("mxfp4"))


@pytest.fixture(scope="module")
def dequantized(mxfp4_checkpoint):
    """The checkpoint loaded with its experts dequantized (``quantization=None``): the reference."""
    return load_model(mxfp4_checkpoint, quantization=None)


PROMPT = random_prompts([40], seed=1)[0]


EXPERTS = ("model", "layers_0", "mlp", "experts")


def test_mxfp4_experts_stay_4_bit_with_the_same_logits_and_tokens(mxfp4_checkpoint, dequantized):
    from jaxinfer import LLM, SamplingParams

    kept = load_model(mxfp4_checkpoint)
    params = traverse_util.flatten_dict(kept.params)
    for name, shape in (("gate_proj", (8, 96, 64)), ("up_proj", (8, 96, 64)), ("down_proj", (8, 64, 96))):
        weight = params[(*EXPERTS, name)]
        assert isinstance(weight, Mxfp4Weight) and weight.shape == shape
        assert weight.blocks.dtype == weight.scales.dtype == jnp.uint8
        assert weight.blocks.nbytes == np.prod(shape) // 2 and weight.scales.nbytes == np.prod(shape) // 32
    plain = traverse_util.flatten_dict(dequantized.params)[(*EXPERTS, "gate_proj")]
    assert plain.dtype == jnp.float32 and plain.shape == (8, 96, 64)

    want = dequantized.logits(PROMPT)
    np.testing.assert_allclose(kept.logits(PROMPT), want, atol=1e-5, rtol=0)
    interpreted = functools.partial(grouped_pallas.moe_mlp, interpret=True)
    with registry.variant("moe.moe_mlp", interpreted, pallas=False), registry.recording() as chosen:
        np.testing.assert_allclose(kept.logits(PROMPT), want, atol=1e-5, rtol=0)  # the kernel reading 4 bits
    assert chosen["moe.moe_mlp"] == {"variant"}

    # Served (a paged prefill, then decode steps) with the experts in 4 bits: the greedy tokens of the
    # dequantized model's forward.
    prompt = random_prompts([9], seed=2)[0]
    llm = LLM(mxfp4_checkpoint, dtype="float32", max_model_len=32, max_num_seqs=1, max_num_batched_tokens=16,
              page_size=8, warmup=False, show_progress=False)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=5,
                                                                                 ignore_eos=True))[0]
    next_logits = lambda ids: dequantized.logits(ids)[-1]  # noqa: E731
    ids = list(prompt)
    for _ in range(5):
        ids.append(int(np.argmax(next_logits(ids))))
    assert_same_greedy_tokens([out.token_ids], [ids[len(prompt):]], [prompt], next_logits)


SPLIT = """
import json, sys
import numpy as np
from flax import traverse_util
from jaxinfer import load_model
from jaxinfer.quantization import Mxfp4Weight
path, ids, want = sys.argv[1], json.loads(sys.argv[2]), np.load(sys.argv[3])
found = {}
for name, options in (("tensor", dict(tensor_parallel_size=2)),
                      ("expert", dict(tensor_parallel_size=2, enable_expert_parallel=True))):
    model = load_model(path, **options)
    params = traverse_util.flatten_dict(model.params)
    pieces = {}
    for proj in ("gate_proj", "down_proj"):
        w = params[("model", "layers_0", "mlp", "experts", proj)]
        kept = isinstance(w, Mxfp4Weight)
        pieces[proj] = [kept, list((w.blocks if kept else w).addressable_shards[0].data.shape)]
    found[name] = {"diff": float(np.abs(model.logits(ids) - want).max()), **pieces}
print(json.dumps(found))
"""


def test_mxfp4_experts_split_over_two_devices(mxfp4_checkpoint, dequantized, tmp_path):
    """Tensor parallel: each device holds half of every expert's width; gate and up stay in MXFP4, down's
    48-column pieces cut its 32-value groups, so it is dequantized on load. Expert parallel: each device
    holds half the experts, whole, in MXFP4. The logits are one device's dequantized ones."""
    np.save(tmp_path / "want.npy", dequantized.logits(PROMPT))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    result = subprocess.run([sys.executable, "-c", SPLIT, mxfp4_checkpoint, json.dumps(PROMPT),
                             str(tmp_path / "want.npy")], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    for name, gate, down in (("tensor", [True, [8, 48, 2, 16]], [False, [8, 64, 48]]),
                             ("expert", [True, [4, 96, 2, 16]], [True, [4, 64, 3, 16]])):
        assert found[name]["gate_proj"] == gate and found[name]["down_proj"] == down, found
        assert found[name]["diff"] < 1e-5, found


def test_info_counts_the_values_and_the_4_bit_bytes(mxfp4_checkpoint, capsys):
    from jaxinfer.cli import main

    assert main(["info", mxfp4_checkpoint, "--max-model-len", "32"]) == 0
    out = capsys.readouterr().out
    tensors = load_file(os.path.join(mxfp4_checkpoint, "model.safetensors"))
    stored = sum(t.nbytes for t in tensors.values())
    values = sum(t.size * (2 if name.endswith("_blocks") else 1) for name, t in tensors.items()
                 if not name.endswith("_scales"))
    assert f"parameters:      {values:,} " in out
    assert (f"quantization:    mxfp4 experts (e2m1 values, one e8m0 scale per 32); {stored / 2**20:.1f} MiB as stored; "
            "experts kept in 4 bits") in out
