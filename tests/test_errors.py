"""Bad input raises a specific error that says what to fix."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxinfer import (LLM, CheckpointError, ConfigError, InvalidRequestError, SamplingParams,
                      TokenizerUnavailableError, UnsupportedArchitectureError, load_model)
from jaxinfer.tiny import write_tiny_checkpoint


@pytest.fixture()
def checkpoint(tmp_path):
    return write_tiny_checkpoint(tmp_path / "ckpt", "llama", with_tokenizer=False, max_position_embeddings=64)


def _edit_config(path, **changes):
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw.update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)


def _edit_tensors(path, edit):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_unknown_architecture_lists_supported(checkpoint):
    _edit_config(checkpoint, architectures=["FancyNewForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError, match="FancyNewForCausalLM.*LlamaForCausalLM"):
        load_model(checkpoint)


def test_missing_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(tmp_path)


def test_unsupported_rope_type(checkpoint):
    _edit_config(checkpoint, rope_parameters={"rope_type": "wavy", "rope_theta": 10000.0})
    with pytest.raises(ConfigError, match="wavy"):
        load_model(checkpoint)


def test_bad_head_counts(checkpoint):
    _edit_config(checkpoint, num_key_value_heads=3)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        load_model(checkpoint)


def test_missing_tensor_is_named(checkpoint):
    _edit_tensors(checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(checkpoint)


def test_misshaped_tensor_is_named(checkpoint):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)

    _edit_tensors(checkpoint, edit)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight: checkpoint gives \[8, 64\], "
                                              r"model expects \[32, 64\]"):
        load_model(checkpoint)


def test_unexpected_tensor_is_named(checkpoint):
    def edit(t):
        t["model.layers.0.self_attn.mystery.weight"] = np.zeros((2,), np.float32)

    _edit_tensors(checkpoint, edit)
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.layers\.0\.self_attn\.mystery\.weight"):
        load_model(checkpoint)


def test_sharded_checkpoint_with_index_loads(checkpoint, tmp_path):
    tensors = load_file(os.path.join(checkpoint, "model.safetensors"))
    names = sorted(tensors)
    out = tmp_path / "sharded"
    shutil.copytree(checkpoint, out)
    os.remove(out / "model.safetensors")
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(out / file))
    with open(out / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {k: file for file, keys in halves.items() for k in keys}}, f)
    ids = [5, 6, 7, 8]
    np.testing.assert_array_equal(load_model(out).logits(ids), load_model(checkpoint).logits(ids))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", with_tokenizer=False,
                                 max_position_embeddings=64)
    return LLM(path, max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, warmup=False, show_progress=False)


@pytest.mark.parametrize("prompt_ids, match", [
    ([], "empty"),
    ([1] * 32, "32 tokens; max_model_len is 32"),
    ([1, 2, 100000], "outside the vocabulary"),
    ([1, -1], "outside the vocabulary"),
])
def test_bad_prompts(llm, prompt_ids, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(prompt_token_ids=[prompt_ids])


def test_bad_prompt_loses_nothing(llm):
    """A batch with one bad prompt is rejected whole before anything is queued; the engine still serves."""
    with pytest.raises(InvalidRequestError):
        llm.generate(prompt_token_ids=[[1, 2, 3], []])
    assert not llm.engine.scheduler.has_work()
    out = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=2))
    assert len(out[0].token_ids) == 2


def test_logits_rejects_bad_ids(llm):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.model.logits([0, 10**6])


def test_text_without_tokenizer(llm):
    with pytest.raises(TokenizerUnavailableError, match="prompt_token_ids"):
        llm.generate("Hello")


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(seed=-1), "seed"),
    (dict(logprobs=-1), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"),
])
def test_invalid_sampling_values(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_request_limits_checked_by_engine(llm):
    with pytest.raises(InvalidRequestError, match="max_logprobs"):
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(logprobs=50))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(stop_token_ids=[10**6]))
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(stop=["x"]))


def test_engine_config_errors(checkpoint):
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        LLM(checkpoint, max_num_seqs=8, max_num_batched_tokens=4, warmup=False, show_progress=False)
    with pytest.raises(ConfigError, match="cannot hold one sequence"):
        LLM(checkpoint, max_model_len=64, page_size=8, num_pages=4, warmup=False, show_progress=False)
    with pytest.raises(ConfigError, match="dtype"):
        LLM(checkpoint, dtype="int4", warmup=False, show_progress=False)
