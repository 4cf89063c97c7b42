"""Multi-head latent attention families (whole-model parity: tests/test_parity.py): YaRN's mscale, a
Kimi-K2.5-style multimodal checkpoint against transformers (its text model), multi-token-prediction
layers skipped; the engine over the latent cache (batching, chunked prefill, preemption, bfloat16);
and tensor parallelism by head on a CPU mesh of fake devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from jaxinfer import load_model
from tests.conftest import assert_greedy_matches_hf, assert_serving_is_consistent, random_prompts
from tests.families import MLA
from tests.families import MLA_CASES as CASES


def test_mscale_changes_the_softmax_scale():
    from jaxinfer.config import ModelConfig
    from jaxinfer.models.deepseek_v3 import yarn_softmax_scale

    config = ModelConfig.from_dict(dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                                        rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=40.0,
                                                             original_max_position_embeddings=4096, mscale=1.0,
                                                             mscale_all_dim=1.0)))
    mscale = 0.1 * np.log(40.0) + 1.0
    assert yarn_softmax_scale(config, 192) == pytest.approx(192 ** -0.5 * mscale ** 2)  # about x1.874


@pytest.fixture(scope="module")
def kimi_k25(tmp_path_factory):
    """A tiny Kimi-K2.5-style checkpoint: a DeepSeek-V3 text model under ``language_model.*`` with a
    vision tower and projector beside it, saved by transformers."""
    import transformers
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config

    from tests.conftest import TINY

    text = dict(model_type="deepseek_v3", **{**TINY, **MLA, "q_lora_rank": 32, "n_group": 1, "topk_group": 1})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=2,
                  pos_emb_height=4, pos_emb_width=4, pos_emb_time=1)
    config = Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=32,
                            tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Kimi_K25ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
            if ".experts." in name and p.dim() >= 2:
                p.normal_(0.0, 0.05)
    path = tmp_path_factory.mktemp("kimi-k25")
    model.save_pretrained(path)
    return str(path), model


def test_kimi_k25_serves_its_text_model(kimi_k25, caplog):
    path, hf_model = kimi_k25
    ids = random_prompts([30], seed=3)[0]
    with torch.no_grad():
        ref = hf_model(input_ids=torch.tensor([ids])).logits[0].numpy()
    with caplog.at_level("WARNING"):
        model = load_model(path, dtype="float32")
    assert sum("vision tower" in r.message for r in caplog.records) == 1
    np.testing.assert_allclose(model.logits(ids), ref, atol=1e-4, rtol=0)
    assert_greedy_matches_hf(path, hf_model, random_prompts([9], seed=4), max_num_seqs=1)


def test_multi_token_prediction_layers_are_skipped(hf_checkpoint, tmp_path, caplog):
    import shutil

    from safetensors.numpy import load_file, save_file

    family, overrides = CASES["no-q-lora-plain-rope"]
    source, _ = hf_checkpoint(family, **{**MLA, **overrides})
    path = shutil.copytree(source, tmp_path / "with-mtp")
    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if n.startswith("model.layers.1.")]:
        tensors[name.replace("model.layers.1.", "model.layers.2.")] = tensors[name]
    save_file(tensors, str(path / "model.safetensors"))
    ids = [5, 9, 13]
    with caplog.at_level("WARNING"):
        logits = load_model(path).logits(ids)
    assert any("multi-token-prediction" in r.message for r in caplog.records)
    np.testing.assert_array_equal(logits, load_model(source).logits(ids))


@pytest.fixture(scope="module")
def mla_engine(hf_checkpoint):
    family, overrides = CASES["q-lora-yarn-interleaved-groups"]
    path, _ = hf_checkpoint(family, **{**MLA, **overrides})
    return path


def test_batched_chunked_and_preempted_equal_one_at_a_time(mla_engine):
    assert_serving_is_consistent(mla_engine)


def test_bfloat16_runs_where_dots_refuse_bfloat16_into_float32(mla_engine):
    """XLA's CPU dots refuse bf16 operands with a float32 result; the absorbed projections round their
    float32 sums to bf16 inside the dot instead, so a bf16 checkpoint runs there and stays near float32."""
    ids = list(range(3, 60))
    full, half = load_model(mla_engine).logits(ids), load_model(mla_engine, "bfloat16").logits(ids)
    assert half.dtype == np.float32 and np.isfinite(half).all()
    assert np.abs(half - full).max() <= 0.02 * np.abs(full).max()


# A subprocess: the fake-device flag must precede jax's start. The checkpoint's layers are all dense,
# so only the attention is split here; the MoE's split has its own tests.
TENSOR_PARALLEL_SCRIPT = textwrap.dedent("""
    import contextlib, json, sys
    import numpy as np
    from flax import traverse_util
    from jaxinfer import LLM, SamplingParams, load_model
    from jaxinfer.kernels import registry
    from tests.conftest import make_hf_checkpoint, random_prompts

    root, family, tp, interpret, overrides = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", \\
        json.loads(sys.argv[5])
    path, _ = make_hf_checkpoint(root, family, **overrides)
    target = (lambda: registry.targeting(registry.Target.interpreted())) if interpret else contextlib.nullcontext
    prompts = random_prompts([13, 5], seed=7)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    options = dict(max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, warmup=False, show_progress=False)
    with target():
        one = load_model(path).logits(prompts[0])
        one_out = LLM(path, **options).generate(prompt_token_ids=prompts, sampling_params=params)
        model = load_model(path, tensor_parallel_size=tp)
        with registry.recording() as chosen:
            split = model.logits(prompts[0])
            split_out = LLM(path, tensor_parallel_size=tp, **options).generate(prompt_token_ids=prompts,
                                                                            sampling_params=params)
    attn = model.params["model"]["layers_0"]["self_attn"]
    print(json.dumps(dict(
        logits_diff=float(np.abs(one - split).max()), logits_scale=float(np.abs(one).max()),
        tokens=[[o.token_ids for o in out] for out in (one_out, split_out)],
        logprobs_diff=max(abs(a[k] - b[k]) for x, y in zip(one_out, split_out)
                          for a, b in zip(x.logprobs, y.logprobs) for k in a),
        pieces={name: [list(w.shape), list(w.addressable_shards[0].data.shape)]
                for name, w in traverse_util.flatten_dict(attn, sep="/").items()},
        kernels={op: sorted(names) for op, names in chosen.items()})))
""")


def run_tensor_parallel(tmp_path, family: str, tp: int, overrides: dict, *, interpret: bool = False) -> dict:
    """``family``'s HF checkpoint at ``overrides`` on ``tp`` fake CPU devices against one: the logits
    of a prompt, greedy tokens and their logprobs through the engine (prefill and decode), each
    attention weight's global and per-device shape, and the ops' implementations chosen."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={tp}"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", TENSOR_PARALLEL_SCRIPT, str(tmp_path), family, str(tp),
                             "1" if interpret else "0", json.dumps(overrides)], env=env, cwd=root,
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["logits_diff"] <= 1e-5 * max(1.0, found["logits_scale"]), found
    assert found["tokens"][0] == found["tokens"][1], found
    assert found["logprobs_diff"] <= 1e-4, found
    return found


def assert_split_by_head(pieces: dict, tp: int, column: tuple[str, ...], replicated: tuple[str, ...]) -> None:
    """The ``column`` projections split by output row (head), o_proj by input column, ``replicated``
    and the norms whole on each device. ``pieces``: {parameter path: [global shape, local shape]}."""
    for name in column:
        (rows, cols), local = pieces[f"{name}/weight"]
        assert local == [rows // tp, cols], (name, pieces[f"{name}/weight"])
    (rows, cols), local = pieces["o_proj/weight"]
    assert local == [rows, cols // tp], pieces["o_proj/weight"]
    for name in [f"{n}/weight" for n in replicated] + [n for n in pieces if "norm" in n]:
        assert pieces[name][0] == pieces[name][1], (name, pieces[name])


def test_tensor_parallel_splits_heads_without_a_q_lora(tmp_path):
    """One head per device (4 of 4): q_proj and kv_b_proj by head, the latent projection whole."""
    family, overrides = CASES["no-q-lora-plain-rope"]
    found = run_tensor_parallel(tmp_path, family, 4, {**MLA, **overrides, "first_k_dense_replace": 2})
    assert_split_by_head(found["pieces"], 4, ("q_proj", "kv_b_proj"), ("kv_a_proj_with_mqa",))
