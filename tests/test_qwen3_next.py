"""The gated-DeltaNet hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE; whole-model parity:
tests/test_parity.py) and the engine over their state slots: greedy tokens as HF's under strict mode
with more sequences than slots (slots handed to new sequences), a mixed workload, batching, chunked
prefill and preemption; the two projection layouts are not interchangeable; tensor parallelism by
head on a CPU mesh of fake devices, with the recurrent states captured on it against HF's cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from jaxinfer import LLM, load_model
from jaxinfer.errors import ConfigError
from tests.conftest import (assert_mixed_workload_runs, assert_serving_is_consistent, assert_slots_handed_on_match_hf,
                            random_prompts, strict_hybrid_engine)
from tests.families import GATED_DELTANET as FAMILIES
from tests.families import HYBRID


@pytest.fixture(scope="module")
def strict_next(hf_checkpoint):
    """Qwen3-Next under strict mode, on the grid of ``assert_serving_is_consistent``'s first engine
    (whose programs are then read from the compilation cache, not compiled again). The three classes
    share the mixer and the state handling; Qwen3.5's own layout and layers are checked by the
    parity tests."""
    path, hf_model = hf_checkpoint("qwen3_next", **FAMILIES["qwen3_next"])
    return strict_hybrid_engine(path), hf_model


def test_greedy_tokens_match_hf_with_slots_handed_on(strict_next):
    assert_slots_handed_on_match_hf(*strict_next)


def test_mixed_sampling_workload_under_strict_mode(strict_next):
    assert_mixed_workload_runs(strict_next[0])


def test_batched_chunked_and_preempted_equal_one_at_a_time(strict_next, hf_checkpoint):
    path, _ = hf_checkpoint("qwen3_next", **FAMILIES["qwen3_next"])
    tight = assert_serving_is_consistent(path)
    assert tight.engine.scheduler.slots.num_free == tight.engine.layout.num_slots


def test_state_bytes_per_sequence(hf_checkpoint):
    """The DeltaNet layer: conv state (3 inputs of 2*2*16 + 4*8 channels, float32 here) and the
    float32 recurrent state 4 x 16 x 8, per sequence; the attention layer alone is paged."""
    path, _ = hf_checkpoint("qwen3_5", **FAMILIES["qwen3_5"])
    layout = LLM(path, dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, page_size=8,
                 warmup=False, show_progress=False).engine.layout
    assert layout.bytes_per_slot == 3 * 96 * 4 + 4 * 16 * 8 * 4
    assert layout.bytes_by_kind()["PagedKV"][0] == 2 * 2 * 16 * 4  # k and v, 2 KV heads of 16


def test_info_shows_the_state_per_sequence(hf_checkpoint, capsys):
    from jaxinfer.cli import main

    path, _ = hf_checkpoint("qwen3_5", **FAMILIES["qwen3_5"])
    assert main(["info", path, "--max-model-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "StateSlots     1 layers, 3.1 KiB per sequence" in out and "PagedKV        1 layers" in out
    assert "prefix caching is off" in out


def test_one_layout_is_not_the_other(tmp_path, hf_checkpoint):
    """A Qwen3-Next checkpoint declared as Qwen3.5 is refused by name: the grouped projections are not
    the flat ones."""
    import json
    import shutil

    path, _ = hf_checkpoint("qwen3_5", **FAMILIES["qwen3_5"])
    other = tmp_path / "as-next"
    shutil.copytree(path, other)
    config = json.loads((other / "config.json").read_text())
    config.update(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next")
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="in_proj_qkvz"):
        load_model(str(other), dtype="float32")


@pytest.mark.parametrize("overrides, message", [
    (dict(linear_num_value_heads=3), r"linear_num_value_heads \(3\) must be a multiple of linear_num_key_heads"),
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
     r"layer_types holds 'sliding_attention'; qwen3_5_text layers are"),
])
def test_bad_hybrid_configs_are_specific_errors(tmp_path, overrides, message):
    import json

    from jaxinfer.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path, "qwen3_5", with_tokenizer=False)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **overrides}))
    with pytest.raises(ConfigError, match=message):
        load_model(path, dtype="float32")


def test_the_multimodal_wrapper_serves_its_text_model(tmp_path, hf_checkpoint):
    """A Qwen3.5 checkpoint as the hub ships it (``Qwen3_5ForConditionalGeneration``: the text model
    under ``model.language_model.*``, its config under ``text_config``) gives the text model's logits."""
    import json

    from safetensors.numpy import load_file, save_file

    path, _ = hf_checkpoint("qwen3_5", **FAMILIES["qwen3_5"])
    text_config = json.loads(open(f"{path}/config.json").read())
    text_config.pop("architectures")
    tensors = {name.replace("model.", "model.language_model.", 1): value
               for name, value in load_file(f"{path}/model.safetensors").items()}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text_config}))
    ids = random_prompts([20], seed=3)[0]
    np.testing.assert_array_equal(load_model(str(tmp_path), dtype="float32").logits(ids),
                                  load_model(path, dtype="float32").logits(ids))


def test_tiny_checkpoint_is_an_hf_checkpoint(tmp_path):
    """The project's own tiny checkpoints, their conv weights and Qwen3.5's in_proj_qkv written back
    in HF's channel order, give transformers the same logits as here."""
    import transformers

    from jaxinfer.tiny import write_tiny_checkpoint

    ids = random_prompts([20], vocab_size=259, seed=3)[0]
    for family, hf_class in (("qwen3_5", transformers.Qwen3_5ForCausalLM),
                             ("qwen3_next", transformers.Qwen3NextForCausalLM)):
        path = write_tiny_checkpoint(tmp_path / family, family, with_tokenizer=False)
        hf_model = hf_class.from_pretrained(path).eval()
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].numpy()
        np.testing.assert_allclose(load_model(path, dtype="float32").logits(ids), ref, atol=1e-4, rtol=0,
                                   err_msg=family)


# A subprocess: the fake-device flag must precede jax's start.
TENSOR_PARALLEL_SCRIPT = textwrap.dedent("""
    import contextlib, json, sys
    import numpy as np, torch
    from flax import traverse_util
    from jaxinfer import LLM, SamplingParams, load_model
    from jaxinfer.cache.layout import CacheLayout
    from jaxinfer.kernels import registry
    from tests.conftest import make_hf_checkpoint, random_prompts

    root, family, tp, interpret, overrides = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", \\
        json.loads(sys.argv[5])
    path, hf_model = make_hf_checkpoint(root, family, **overrides)
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
            states = model.forward(prompts[0], capture="recurrent_states").recurrent_states
            split_out = LLM(path, tensor_parallel_size=tp, **options).generate(prompt_token_ids=prompts,
                                                                            sampling_params=params)
    with torch.no_grad():
        cache = hf_model(torch.tensor([prompts[0]]), use_cache=True).past_key_values

    def hf_states(layer):  # batch row 0; HF keeps the last K conv inputs, channels first
        if hasattr(cache, "linear_cache"):
            return {"recurrent_state": cache.linear_cache[layer][0].numpy()}
        entry = cache.layers[layer]
        return {"recurrent_state": entry.recurrent_states[0][0].numpy(),
                "conv_state": entry.conv_states[0][0].numpy()[:, 1:].T}

    first = min(states)
    layout = CacheLayout(model.model_cls.cache_specs(model.config), 8, 4, model.dtype, num_slots=2)
    mixer = next(v for k, v in model.params["model"][f"layers_{first}"].items() if k in ("linear_attn", "self_attn"))
    print(json.dumps(dict(
        logits_diff=float(np.abs(one - split).max()), logits_scale=float(np.abs(one).max()),
        tokens=[[o.token_ids for o in out] for out in (one_out, split_out)],
        logprobs_diff=max(abs(a[k] - b[k]) for x, y in zip(one_out, split_out)
                          for a, b in zip(x.logprobs, y.logprobs) for k in a),
        states_diff={f"{layer}/{name}": float(np.abs(value - hf_states(layer)[name]).max())
                     for layer, arrays in states.items() for name, value in arrays.items()},
        pieces={name: [list(w.shape), list(w.addressable_shards[0].data.shape)]
                for name, w in traverse_util.flatten_dict(mixer, sep="/").items()},
        cache_specs={name: [list(a) if isinstance(a, tuple) else a for a in spec]
                     for name, spec in layout.partition_specs(model.plan)[first].items()},
        kernels={op: sorted(names) for op, names in chosen.items()})))
""")


def run_tensor_parallel(tmp_path, family: str, tp: int, overrides: dict, *, interpret: bool = False) -> dict:
    """``family``'s HF checkpoint at ``overrides`` on ``tp`` fake CPU devices against one: the logits
    of a prompt, greedy tokens and their logprobs through the engine (prefill and decode), the
    recurrent states captured on ``tp`` devices against HF's cache, the first linear-attention
    layer's parameters (global and per-device shapes) and cache partition specs, and the ops'
    implementations chosen."""
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
    assert found["states_diff"] and max(found["states_diff"].values()) <= 1e-4, found["states_diff"]
    return found


def assert_split(pieces: dict, tp: int, rows: tuple[str, ...], columns: tuple[str, ...] = (),
                 whole: tuple[str, ...] = ()) -> None:
    """``rows``: parameters split along their first dimension; ``columns``: along their last (the
    row-parallel output projection); ``whole`` (and every norm not named) on each device entire.
    ``pieces``: {parameter path: [global shape, local shape]}."""
    for name in rows:
        shape, local = pieces[name]
        assert local == [shape[0] // tp, *shape[1:]], (name, pieces[name])
    for name in columns:
        shape, local = pieces[name]
        assert local == [*shape[:-1], shape[-1] // tp], (name, pieces[name])
    for name in whole:
        assert pieces[name][0] == pieces[name][1], (name, pieces[name])


DENSE = dict(mlp_only_layers=[0, 1])  # Qwen3-Next with a dense MLP in both layers: only the mixers split here


def test_tensor_parallel_splits_key_and_value_heads(tmp_path):
    """Qwen3.5 on 4 devices, one key head and two value heads each: the flat in_proj_qkv (re-laid out
    per key head on load), z, b, a, the conv weight, A_log and dt_bias by head, out_proj by column;
    the conv and recurrent state slots split by head; the states captured in HF's layout."""
    found = run_tensor_parallel(tmp_path, "qwen3_5", 4, dict(HYBRID, linear_num_key_heads=4, linear_num_value_heads=8))
    assert_split(found["pieces"], 4, ("in_proj_qkv/weight", "in_proj_z/weight", "in_proj_b/weight", "in_proj_a/weight",
                                      "conv1d/weight", "A_log", "dt_bias"), ("out_proj/weight",), ("norm/weight",))
    tensor = ["model", "kv_replica"]
    assert found["cache_specs"] == {"conv_state": [None, None, tensor],
                                    "recurrent_state": [None, tensor, None, None]}, found["cache_specs"]



def test_key_heads_that_do_not_split_are_a_config_error():
    """Value heads that split over 4 devices but key heads that do not: refused before loading, naming
    the conv weight (a key head is never cut)."""
    from jaxinfer.config import ModelConfig
    from jaxinfer.registry import ModelRegistry
    from jaxinfer.sharding.for_model import abstract_plan
    from jaxinfer.tiny import tiny_config
    from jaxinfer.weights import declared_params

    config = ModelConfig.from_dict(tiny_config("qwen3_5", linear_num_key_heads=2, linear_num_value_heads=4))
    model_cls = ModelRegistry.resolve(config.architecture)
    shapes, axes = declared_params(model_cls, config, np.float32)
    with pytest.raises(ConfigError, match=r"linear_attn\.conv1d\.weight dim 0 \(2\)"):
        abstract_plan(model_cls, config, shapes, axes, tensor_parallel_size=4)
