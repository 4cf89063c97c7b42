"""Fine-grained FP8 checkpoints (``quant_method: fp8``, as transformers and the hub's DeepSeek-V3 and
Qwen3-FP8 store them): e4m3 Linear weights with float32 scales per block or per tensor, dequantised on
load. Parity against HF run on the dequantised weights; checkpoints whose scales or quantization_config
are malformed are refused, naming the tensor or key."""

from __future__ import annotations

import json
import os
import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from jaxinfer import load_model
from jaxinfer.errors import CheckpointError, ConfigError
from tests.conftest import assert_logits_and_greedy_match_hf, make_hf_checkpoint, random_prompts
from tests.families import MLA, MLA_CASES, MOE, MOE_CASES

E4M3_MAX = 448.0
# Divides none of the tiny models' widths (16 ... 112): every matrix ends in ragged blocks.
BLOCK = (20, 28)

CASES = {
    "llama": ("llama", {}),
    "qwen3_moe": ("qwen3_moe", dict(MOE, **MOE_CASES["qwen3_moe"][1])),
    "deepseek_v3": ("deepseek_v3", dict(MLA, **MLA_CASES["q-lora-yarn-interleaved-groups"][1])),
}


def quantize(w: torch.Tensor, block):
    """-> (e4m3 values, float32 scales, the dequantised weight) of ``w`` [out, in]: a scale of
    max |w| / 448 per ``block`` (rows, cols), the last ones ragged, or one for the tensor (None)."""
    if block is None:
        scale = w.abs().max() / E4M3_MAX
        q = (w / scale).to(torch.float8_e4m3fn)
        return q, scale, q.float() * scale
    (rows, cols), (bo, bi) = w.shape, block
    padded = torch.zeros(-(-rows // bo) * bo, -(-cols // bi) * bi)
    padded[:rows, :cols] = w
    scale = padded.reshape(padded.shape[0] // bo, bo, padded.shape[1] // bi, bi).abs().amax(dim=(1, 3)) / E4M3_MAX
    expanded = scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:rows, :cols]
    q = (w / expanded).to(torch.float8_e4m3fn)
    return q, scale, q.float() * expanded


def hf_parameter(model, name: str) -> torch.Tensor:
    """The HF parameter (or view of one) that the saved tensor ``name`` holds: experts saved one by one
    are slices of HF's fused ``gate_up_proj`` / ``down_proj`` [experts, out, in]."""
    m = re.fullmatch(r"(.+\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
    if m is None:
        return model.get_parameter(name)
    prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
    if proj == "down":
        return model.get_parameter(f"{prefix}.down_proj")[expert]
    gate_up = model.get_parameter(f"{prefix}.gate_up_proj")[expert]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if proj == "gate" else gate_up[half:]


def write_fp8_checkpoint(path, family: str, block=BLOCK, not_converted=(), **overrides):
    """A random HF checkpoint of ``family`` whose decoder-layer Linear weights (2-D, routers aside) are
    stored in e4m3 with ``weight_scale_inv`` per ``block`` or, for None, a ``weight_scale`` scalar;
    modules named in ``not_converted`` stay float32 and are listed in ``modules_to_not_convert``.
    -> (path, the HF model on the dequantised weights)."""
    path, model = make_hf_checkpoint(path, family, **overrides)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    with torch.no_grad():
        for name, w in list(tensors.items()):
            if (not name.startswith("model.layers.") or not name.endswith(".weight") or w.dim() != 2
                    or name.endswith("mlp.gate.weight") or name[:-len(".weight")] in not_converted):
                continue
            q, scale, dequantised = quantize(w, block)
            hf_parameter(model, name).copy_(dequantised)
            tensors[name] = q
            tensors[name + ("_scale_inv" if block else "_scale")] = scale
    save_file(tensors, file, metadata={"format": "pt"})
    quantization = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic")
    if block:
        quantization["weight_block_size"] = list(block)
    if not_converted:
        quantization["modules_to_not_convert"] = list(not_converted)
    edit_config(path, quantization)
    return path, model


def edit_config(path, quantization: dict) -> None:
    """Update config.json's quantization_config with ``quantization``."""
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw["quantization_config"] = {**raw.get("quantization_config", {}), **quantization}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    cache = {}

    def get(case: str):
        if case not in cache:
            family, overrides = CASES[case]
            cache[case] = write_fp8_checkpoint(tmp_path_factory.mktemp(f"fp8-{case}"), family, **overrides)
        return cache[case]

    return get


@pytest.mark.parametrize("case", sorted(CASES))
def test_block_quantized_logits_and_greedy_tokens_match_hf(case, fp8_checkpoint):
    assert_logits_and_greedy_match_hf(*fp8_checkpoint(case))


def test_per_tensor_scales_and_modules_not_converted(tmp_path):
    """One scale per weight; a decoder Linear (and lm_head) in modules_to_not_convert, stored in float32."""
    path, hf_model = write_fp8_checkpoint(tmp_path, "llama", block=None,
                                          not_converted=("lm_head", "model.layers.1.mlp.down_proj"))
    ids = random_prompts([40], seed=1)[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(load_model(path, dtype="float32").logits(ids), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("rows, cols", [(slice(0, 32), slice(None)), (slice(32, 64), slice(None)),
                                        (slice(None), slice(16, 48)), (slice(8, 56), slice(30, 31))])
def test_a_slice_reads_as_that_slice_of_the_whole_weight(rows, cols, fp8_checkpoint):
    """What one device reads of a split weight (its rows or columns, across block boundaries) equals
    that part of the whole dequantised weight, and the whole equals HF's."""
    from jaxinfer.loader import open_checkpoint

    path, hf_model = fp8_checkpoint("llama")
    _, _, checkpoint = open_checkpoint(path)
    name = "model.layers.1.self_attn.o_proj.weight"  # [64, 64]: blocks of 20 x 28 straddle every split
    whole = checkpoint.read(name)
    np.testing.assert_array_equal(whole, hf_parameter(hf_model, name).detach().numpy())
    np.testing.assert_array_equal(checkpoint.read(name, (rows, cols)), whole[rows, cols])


Q, K = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"
O, DOWN = "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.down_proj"


def with_first(scale: torch.Tensor, value: float) -> torch.Tensor:
    scale = scale.clone()
    scale[0, 0] = value
    return scale


# Case -> ({tensor: its replacement, a function of the stored one (None where absent); None removes
# it}, the tensor the error names, a word of the error).
BAD_TENSORS = {
    "scale-of-the-wrong-shape": ({f"{Q}.weight_scale_inv": lambda s: s[:, :-1].clone()}, f"{Q}.weight_scale_inv",
                                 "shape"),
    "weight-without-its-scale": ({f"{DOWN}.weight_scale_inv": lambda s: None}, f"{DOWN}.weight", "scale"),
    "scale-without-its-weight": ({"model.layers.0.self_attn.qkv_proj.weight_scale_inv": lambda s: torch.ones(8, 3)},
                                 "model.layers.0.self_attn.qkv_proj.weight_scale_inv", ""),
    "integer-scale": ({f"{K}.weight_scale_inv": lambda s: torch.ones_like(s, dtype=torch.int32)},
                      f"{K}.weight_scale_inv", "dtype"),
    **{f"scale-{value}": ({f"{O}.weight_scale_inv": lambda s, value=value: with_first(s, value)},
                          f"{O}.weight_scale_inv", "positive") for value in (0.0, -1.0, float("nan"))},
}


def broken_copy(source, dest, tensors=None, quantization=None):
    """A copy of the checkpoint ``source`` at ``dest``, its tensors replaced as ``tensors`` says (see
    BAD_TENSORS) and its quantization_config updated with ``quantization``."""
    shutil.copytree(source, dest)
    if tensors:
        file = os.path.join(dest, "model.safetensors")
        stored = load_file(file)
        for name, replace in tensors.items():
            new = replace(stored.get(name))
            if new is None:
                del stored[name]
            else:
                stored[name] = new
        save_file(stored, file, metadata={"format": "pt"})
    if quantization:
        edit_config(dest, quantization)
    return str(dest)


@pytest.mark.parametrize("case", sorted(BAD_TENSORS))
def test_bad_scales_are_refused_naming_the_tensor(case, fp8_checkpoint, tmp_path):
    tensors, name, word = BAD_TENSORS[case]
    path = broken_copy(fp8_checkpoint("llama")[0], tmp_path / "bad", tensors=tensors)
    with pytest.raises(CheckpointError, match=re.escape(name) + (f".*{word}" if word else "")):
        load_model(path)


@pytest.mark.parametrize("quantization, match", [
    (dict(quant_method="awq"), "quant_method"),
    (dict(fmt="e5m2"), "fmt"),
    (dict(weight_block_size=[0, 16]), "weight_block_size"),
    (dict(weight_block_size=[20, 28, 1]), "weight_block_size"),
], ids=["awq", "e5m2", "zero-block", "three-sizes"])
def test_bad_quantization_config_is_refused(quantization, match, fp8_checkpoint, tmp_path):
    path = broken_copy(fp8_checkpoint("llama")[0], tmp_path / "bad", quantization=quantization)
    with pytest.raises(ConfigError, match=match):
        load_model(path)


def test_a_module_not_to_convert_stored_in_fp8_is_refused(fp8_checkpoint, tmp_path):
    path = broken_copy(fp8_checkpoint("llama")[0], tmp_path / "bad", quantization=dict(modules_to_not_convert=[Q]))
    with pytest.raises(CheckpointError, match=re.escape(f"{Q}.weight") + ".*modules_to_not_convert"):
        load_model(path)


def test_weights_stay_fp8_on_the_device(fp8_checkpoint):
    """By default (quantization="auto") the linears and the stacked experts keep their fp8 values and
    float32 block scales on the device; quantization=None dequantizes them, with the same logits."""
    from flax import traverse_util

    from jaxinfer.quantization import Fp8Weight

    path, _ = fp8_checkpoint("qwen3_moe")
    kept, dequantized = load_model(path), load_model(path, quantization=None)
    params = traverse_util.flatten_dict(kept.params)
    q_proj = params[("model", "layers_0", "self_attn", "q_proj", "weight")]
    assert isinstance(q_proj, Fp8Weight) and q_proj.values.dtype == jnp.float8_e4m3fn
    out, cols = q_proj.values.shape
    assert q_proj.values.nbytes == out * cols and q_proj.scales.shape == (-(-out // BLOCK[0]), -(-cols // BLOCK[1]))
    gate = params[("model", "layers_0", "mlp", "experts", "gate_proj")]
    assert isinstance(gate, Fp8Weight) and gate.values.dtype == jnp.float8_e4m3fn and gate.scales.ndim == 3
    plain = traverse_util.flatten_dict(dequantized.params)
    assert not any(isinstance(v, Fp8Weight) for v in plain.values())
    ids = random_prompts([40], seed=1)[0]
    np.testing.assert_allclose(kept.logits(ids), dequantized.logits(ids), atol=1e-6, rtol=0)


def test_an_export_takes_the_kept_fp8_weights(fp8_checkpoint, tmp_path):
    """An export of an engine that keeps fp8 weights records them with their parts and serves the live
    engine's tokens from them; loading the checkpoint dequantized for it is a mismatch."""
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.engine.manifest import Manifest
    from jaxinfer.errors import ExportMismatchError

    path, _ = fp8_checkpoint("llama")
    with pytest.raises(ConfigError, match="quantization must be 'auto'"):
        load_model(path, quantization="fp8")
    options = dict(dtype="float32", max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, warmup=False,
                   show_progress=False)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompt = random_prompts([9], seed=3)[0]
    live = LLM(path, **options)
    expected = live.generate(prompt_token_ids=[prompt], sampling_params=greedy)[0].token_ids
    live.export(tmp_path / "export")
    entries = {"/".join(p["path"]): p for p in Manifest.read(str(tmp_path / "export")).params}
    q_proj = entries["model/layers_0/self_attn/q_proj/weight"]["quantized"]["parts"]
    assert [part["dtype"] for part in q_proj] == ["float8_e4m3fn", "float32"], q_proj
    served = LLM(path, executables=tmp_path / "export", show_progress=False)
    assert served.generate(prompt_token_ids=[prompt], sampling_params=greedy)[0].token_ids == expected
    with pytest.raises(ExportMismatchError, match="quantization=None keeps 0 quantized"):
        LLM(path, executables=tmp_path / "export", quantization=None, show_progress=False)


TENSOR_PARALLEL = """
import json, sys
import numpy as np
from flax import traverse_util
from jaxinfer import load_model
from jaxinfer.quantization import Fp8Weight
path = sys.argv[1]
ids = list(range(3, 43))
one, two = load_model(path), load_model(path, tensor_parallel_size=2)
params = traverse_util.flatten_dict(two.params)
def piece(name):
    w = params[("model", "layers_0", "self_attn", name, "weight")]
    kept = isinstance(w, Fp8Weight)
    return [kept, list((w.values if kept else w).addressable_shards[0].data.shape)]
print(json.dumps({"diff": float(np.abs(one.logits(ids) - two.logits(ids)).max()),
                  "q_proj": piece("q_proj"), "o_proj": piece("o_proj")}))
"""


def test_a_split_keeps_fp8_where_blocks_align_with_the_pieces(tmp_path):
    """At TP = 2 (hidden 64, blocks 16 x 24): q_proj's 32-row pieces are whole blocks and stay fp8;
    o_proj's 32-column pieces cut blocks of 24, so it is dequantized; the logits are one device's."""
    import subprocess
    import sys

    path, _ = write_fp8_checkpoint(tmp_path / "ckpt", "llama", block=(16, 24))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    result = subprocess.run([sys.executable, "-c", TENSOR_PARALLEL, path], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["diff"] < 1e-5, found
    assert found["q_proj"] == [True, [32, 64]] and found["o_proj"] == [False, [64, 32]], found
