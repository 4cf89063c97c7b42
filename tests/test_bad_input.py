"""The catalogue of bad input: one case per class, each raising its specific error with a message
that names the culprit, before anything is allocated, and leaving the engine serving.

Sections: config, weights, tokenizer, requests and sampling, engine options, generation defaults, CLI.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxinfer import (LLM, CheckpointError, ConfigError, InvalidRequestError, ModelConfig, SamplingParams,
                      TokenizerUnavailableError, UnsupportedArchitectureError, load_model)
from jaxinfer.tiny import write_tiny_checkpoint


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """Tiny checkpoints per family, written once; tests edit copies."""
    made = {}

    def get(family, tokenizer=False):
        key = (family, tokenizer)
        if key not in made:
            made[key] = write_tiny_checkpoint(tmp_path_factory.mktemp(family), family, with_tokenizer=tokenizer,
                                              max_position_embeddings=64)
        return made[key]

    return get


@pytest.fixture()
def copy_of(templates, tmp_path):
    def make(family="llama", tokenizer=False):
        return shutil.copytree(templates(family, tokenizer), tmp_path / "ckpt")

    return make


def edit_json(path, name, **changes):
    file = os.path.join(path, name)
    with open(file) as f:
        raw = json.load(f)
    raw.update(changes)
    with open(file, "w") as f:
        json.dump(raw, f)


def edit_tensors(path, edit, file="model.safetensors"):
    full = os.path.join(path, file)
    tensors = load_file(full)
    edit(tensors)
    save_file(tensors, full)


SMALL = dict(max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, page_size=8, warmup=False,
             show_progress=False)


# ---- config ---------------------------------------------------------------------------------------

LLAMA3 = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "original_max_position_embeddings": 32}
CONFIG_CASES = [
    ("llama", {"hidden_size": "64"}, r"hidden_size.*expected int"),
    ("llama", {"num_hidden_layers": 0}, r"num_hidden_layers must be an integer >= 1, got 0"),
    ("llama", {"num_attention_heads": -4}, r"num_attention_heads must be an integer >= 1, got -4"),
    ("llama", {"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    ("llama", {"head_dim": 15}, r"even rotary dimension, but got `head_dim`=15"),  # transformers' own check
    ("llama", {"intermediate_size": -1}, r"intermediate_size must be an integer >= 1, got -1"),
    ("llama", {"max_position_embeddings": 0}, r"max_position_embeddings must be an integer >= 1"),
    ("llama", {"rms_norm_eps": 0.0}, r"rms_norm_eps must be a finite number > 0, got 0.0"),
    ("llama", {"hidden_act": "wiggle"}, r"hidden_act 'wiggle' is not supported"),
    ("llama", {"tie_word_embeddings": "yes"}, r"tie_word_embeddings"),
    ("llama", {"eos_token_id": -1}, r"eos_token_id\[0\] must be an integer >= 0, got -1"),
    ("llama", {"eos_token_id": [2, "eos"]}, r"eos_token_id"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, r"rope_theta must be .* > 0"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 0.0}},
     r"rope_parameters.factor must be a finite number > 0, got 0.0"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.5}},
     r"partial_rotary_factor must be a finite number > 0 and <= 1, got 1.5"),
    ("llama", {"rope_parameters": {**LLAMA3, "low_freq_factor": 4.0, "high_freq_factor": 1.0}},
     r"high_freq_factor \(1.0\) must be greater than low_freq_factor \(4.0\)"),
    ("llama", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "long_factor": [1.0] * 3,
                                   "short_factor": [1.0] * 8, "original_max_position_embeddings": 32}},
     r"long_factor has 3 entries; a rotary width of 16 needs 8"),
    ("llama", {"rope_parameters": {"rope_type": "wavy", "rope_theta": 1e4}}, r"rope type 'wavy' is not supported"),
    ("llama", {"architectures": []}, r"'architectures' list"),
    ("llama", {"model_type": "nonexistent"}, r"model_type 'nonexistent' is unknown to transformers"),
    ("llama", {"vocab_size": 300}, r"vocab_size is 300, but the checkpoint's model.embed_tokens.weight has shape"),
    ("llama", {"hidden_size": 48, "head_dim": 16}, r"hidden_size is 48, but the checkpoint's"),
    ("llama", {"num_hidden_layers": 3}, r"num_hidden_layers is 3, but the checkpoint's tensors hold 2 layers"),
    ("mistral", {"sliding_window": 0}, r"sliding_window must be an integer >= 1, got 0"),
    ("qwen2", {"layer_types": ["mamba", "full_attention"]},  # as written, not as transformers renames it
     r"layer_types holds 'mamba'; qwen2 layers are 'sliding_attention' or 'full_attention'"),
    ("qwen2", {"layer_types": ["full_attention", "diagonal_attention"]}, r"layer_types"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, r"num_experts_per_tok must be an integer >= 1 and <= 8, got 9"),
    ("qwen3_moe", {"num_experts": 16}, r"num_experts is 16, but the checkpoint's tensors hold experts 0..7"),
    ("qwen3_moe", {"mlp_only_layers": [5]}, r"mlp_only_layers\[0\] must be an integer >= 0 and <= 1, got 5"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, r"decoder_sparse_step must be an integer >= 1, got 0"),
    ("gpt_oss", {"swiglu_limit": -1.0}, r"swiglu_limit must be a finite number > 0"),
]


@pytest.mark.parametrize("family, changes, match", CONFIG_CASES,
                         ids=[f"{f}-{'-'.join(c)}" for f, c, _ in CONFIG_CASES])
def test_bad_config_value_is_named(copy_of, family, changes, match):
    path = copy_of(family)
    edit_json(path, "config.json", **changes)
    with pytest.raises(ConfigError, match=match):
        load_model(path)


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa", "sarvam_mla"])
def test_a_model_type_needing_a_later_transformers_says_which(model_type, monkeypatch):
    import transformers

    from jaxinfer.config import hf_config_from_dict

    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(ConfigError, match=rf"model_type '{model_type}' needs transformers >= 5.24 \(installed: "
                                          r"5.17.0\)"):
        hf_config_from_dict({"model_type": model_type})


def test_rotary_width_is_checked():
    from jaxinfer.config import RopeConfig

    with pytest.raises(ConfigError, match=r"int\(16 \* 0.3125\) = 5 must be an even number >= 2"):
        RopeConfig(partial_rotary_factor=0.3125).check_rotary_dim(16)
    with pytest.raises(ConfigError, match=r"= 2 must be an even number >= 4"):  # dynamic NTK divides by dim - 2
        RopeConfig(rope_type="dynamic", factor=2.0).check_rotary_dim(2)
    assert RopeConfig(partial_rotary_factor=0.5).check_rotary_dim(16) == 8


MAMBA = ["mamba", "linear_attention", "linear_attention", "full_attention"]
HYBRID_KINDS = r"layer_types holds 'mamba'; {} layers are 'linear_attention' or 'full_attention' \(transformers " \
               r"reads 'mamba' as 'linear_attention': write that if it is meant\)"
KDA = dict(kda_layers=[1, 2, 3], full_attn_layers=[4], num_heads=2, head_dim=16, short_conv_kernel_size=4)
LAYER_PATTERN_CASES = [
    ("qwen3_next", {"layer_types": MAMBA}, HYBRID_KINDS.format("qwen3_next")),
    ("qwen3_5", {"layer_types": MAMBA}, HYBRID_KINDS.format("qwen3_5_text")),
    ("minimax", {"layer_types": ["mamba", "full_attention"]}, HYBRID_KINDS.format("minimax")),
    ("kimi_linear", {"layer_types": MAMBA}, HYBRID_KINDS.format("kimi_linear")),
    ("gemma3", {"layer_types": ["full_attention", "mamba"]},
     r"layer_types holds 'mamba'; gemma3_text layers are 'sliding_attention' or 'full_attention'$"),
    ("gpt_oss", {"layer_types": ["chunked_attention", "full_attention"]},
     r"layer_types holds 'chunked_attention'; gpt_oss layers are 'sliding_attention' or 'full_attention'$"),
    ("glm_moe_dsa", {"indexer_types": ["full", "dense"]}, r"indexer_types holds 'dense'; glm_moe_dsa layers are 'full' or 'shared'"),
    ("qwen3_next", {"layer_types": None, "full_attention_interval": 0}, r"full_attention_interval must be an integer >= 1, got 0"),
    ("qwen3_5", {"layer_types": None, "full_attention_interval": -2}, r"full_attention_interval must be an integer >= 1, got -2"),
    ("kimi_linear", {"linear_attn_config": {**KDA, "kda_layers": [1, 2, 7]}},
     r"linear_attn_config.kda_layers\[2\] must be an integer >= 1 and <= 4, got 7"),
    ("kimi_linear", {"linear_attn_config": {**KDA, "kda_layers": [0, 1, 2, 3]}},  # 0 would be layer -1 in transformers
     r"linear_attn_config.kda_layers\[0\] must be an integer >= 1 and <= 4, got 0"),
    ("kimi_linear", {"linear_attn_config": {**KDA, "full_attn_layers": [3]}},
     r"kda_layers \[1, 2, 3\] and full_attn_layers \[3\] must name each of the layers 1..4 exactly once"),
    ("kimi_linear", {"linear_attn_config": {**KDA, "full_attn_layers": "4"}},
     r"linear_attn_config.full_attn_layers must be a list of integers, got '4'"),
    ("kimi_linear", {"linear_attn_config": [1, 2, 3, 4]}, r"linear_attn_config must be a mapping \(kda_layers, .*got \[1, 2, 3, 4\]"),
    ("minimax_m2", {"rotary_dim": 64}, r"rotary_dim must be an even integer >= 2 and <= head_dim \(16\), got 64"),
]


@pytest.mark.parametrize("family, changes, match", LAYER_PATTERN_CASES,
                         ids=[f"{f}-{'-'.join(c)}-{i}" for i, (f, c, _) in enumerate(LAYER_PATTERN_CASES)])
def test_bad_layer_pattern_is_named(family, changes, match):
    """Every family's per-layer kind lists go through one check (values as config.json writes them),
    and the fields transformers derives them from are checked before transformers computes with them."""
    from jaxinfer.registry import ModelRegistry
    from jaxinfer.tiny import tiny_config

    with pytest.raises(ConfigError, match=match):
        config = ModelConfig.from_dict(tiny_config(family, **changes))
        ModelRegistry.resolve(config.architecture).validate_config(config)


def test_a_config_claiming_a_million_layers_fails_in_milliseconds(copy_of):
    path = copy_of("qwen3_moe")
    edit_json(path, "config.json", num_hidden_layers=10**6)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="num_hidden_layers is 1000000"):
        load_model(path)
    assert time.perf_counter() - start < 1.0
    edit_json(path, "config.json", num_hidden_layers=2, num_experts=10**6)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="num_experts is 1000000"):
        load_model(path)
    assert time.perf_counter() - start < 1.0


def test_eos_ids_beyond_the_vocabulary_are_dropped_with_a_warning(copy_of):
    path = copy_of()
    edit_json(path, "config.json", eos_token_id=[2, 10**6])
    with pytest.warns(UserWarning, match=r"eos_token_id \[1000000\] lies beyond the vocabulary"):
        config = ModelConfig.from_pretrained(path)
    assert config.eos_token_ids == (2,)


def test_config_file_itself(tmp_path, copy_of):
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(tmp_path)
    with pytest.raises(ConfigError, match="is not a folder"):
        load_model(tmp_path / "nowhere")
    path = copy_of()
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ConfigError, match="config.json is not valid JSON"):
        load_model(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump([1, 2], f)
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        load_model(path)


def test_unknown_architecture_lists_supported(copy_of):
    path = copy_of()
    edit_json(path, "config.json", architectures=["FancyNewForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError, match="FancyNewForCausalLM.*LlamaForCausalLM"):
        load_model(path)


def _plant_remote_code(path, marker) -> None:
    """A module in the checkpoint folder that would create ``marker`` if anything imported it."""
    code = (f"open({str(marker)!r}, 'w').write('ran')\n"
            "from transformers import LlamaConfig, PreTrainedTokenizerFast\n"
            "class EvilConfig(LlamaConfig):\n    model_type = 'evil'\n"
            "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    with open(os.path.join(path, "evil.py"), "w") as f:
        f.write(code)


def test_config_that_needs_remote_code_is_refused_and_never_run(copy_of, tmp_path):
    path = copy_of()
    marker = tmp_path / "marker"
    _plant_remote_code(path, marker)
    edit_json(path, "config.json", model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig"})
    with pytest.raises(ConfigError, match="defined by code shipped with the checkpoint.*never runs code"):
        LLM(path, **SMALL)
    assert not marker.exists()


def test_defaults_are_hf_config_classes_defaults(hf_checkpoint, tmp_path):
    """Fields a config.json leaves out take the defaults of transformers' class for the model type
    (Qwen3's head_dim is 128, not hidden_size // heads; MiniMax-M2's rope_theta is 5e6, not 1e4), so
    the logits match HF's for the same folder."""
    import torch
    from transformers import AutoModelForCausalLM

    for family, drop in (("qwen3", "head_dim"), ("minimax_m2", "rope_parameters")):
        source, _ = hf_checkpoint(family)
        path = shutil.copytree(source, tmp_path / family)
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        raw.pop(drop)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(raw, f)
        hf = AutoModelForCausalLM.from_pretrained(path).eval()
        ids = [1, 5, 9, 14, 33, 70]
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].numpy()
        np.testing.assert_allclose(load_model(path).logits(ids), ref, atol=1e-4)


# ---- weights --------------------------------------------------------------------------------------


def _split_into_shards(path, names_per_file: dict[str, list[str]] | None = None, index: dict | None = None):
    """Re-save ``path``'s tensors as two shards (even / odd names) plus, optionally, an index."""
    tensors = load_file(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors"))
    names = sorted(tensors)
    names_per_file = names_per_file or {"model-00001-of-00002.safetensors": names[::2],
                                        "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in names_per_file.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(path, file))
    if index is None:
        index = {"weight_map": {k: file for file, keys in names_per_file.items() for k in keys}}
    if index is not False:
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f)
    return tensors, names_per_file


def test_sharded_checkpoint_with_index_loads(copy_of, templates):
    path = copy_of()
    _split_into_shards(path)
    ids = [5, 6, 7, 8]
    np.testing.assert_array_equal(load_model(path).logits(ids), load_model(templates("llama")).logits(ids))


@pytest.mark.parametrize("entry", ["../outside.safetensors", "ABSOLUTE", "sub/../../outside.safetensors"])
def test_index_entries_outside_the_folder_are_refused(copy_of, tmp_path, entry):
    path = copy_of()
    tensors, files = _split_into_shards(path, index=False)
    outside = tmp_path / "outside.safetensors"  # a loadable file next to the folder
    second = "model-00002-of-00002.safetensors"
    shutil.copy(os.path.join(path, second), outside)
    entry = str(outside) if entry == "ABSOLUTE" else entry
    weight_map = {k: (entry if file == second else file) for file, keys in files.items() for k in keys}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    with pytest.raises(CheckpointError, match="not a plain file name inside the checkpoint folder"):
        load_model(path)


def test_symlinks_out_of_the_folder_are_refused(copy_of, tmp_path):
    path = copy_of()
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(os.path.join(path, "model.safetensors"), outside)
    os.symlink(outside, os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError, match="'model.safetensors' .* is a symlink to .*outside the checkpoint folder"):
        load_model(path)


def test_a_symlink_inside_the_folder_is_followed(copy_of):
    path = copy_of()
    os.makedirs(os.path.join(path, "blobs"))
    shutil.move(os.path.join(path, "model.safetensors"), os.path.join(path, "blobs", "weights"))
    os.symlink(os.path.join("blobs", "weights"), os.path.join(path, "model.safetensors"))
    assert load_model(path).logits([1, 2]).shape == (2, 259)


def test_the_hub_cache_layout_loads(templates, tmp_path):
    """A hub-cache snapshot's files are symlinks into the repository's blobs/ folder: allowed."""
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    os.makedirs(repo / "blobs")
    os.makedirs(snapshot)
    for i, name in enumerate(sorted(os.listdir(templates("llama")))):
        shutil.copy(os.path.join(templates("llama"), name), repo / "blobs" / f"blob{i}")
        os.symlink(os.path.join("..", "..", "blobs", f"blob{i}"), snapshot / name)
    assert load_model(snapshot).logits([1, 2]).shape == (2, 259)


def test_pickle_weights_are_never_loaded(copy_of, tmp_path):
    path = copy_of()
    os.remove(os.path.join(path, "model.safetensors"))
    marker = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with open(os.path.join(path, "pytorch_model.bin"), "wb") as f:
        pickle.dump(Payload(), f)
    with pytest.raises(CheckpointError, match=r"PyTorch pickle weights \(pytorch_model.bin\).*never unpickles"):
        load_model(path)
    assert not marker.exists()


def test_a_tensor_in_two_shards_is_named(copy_of):
    path = copy_of()
    tensors = load_file(os.path.join(path, "model.safetensors"))
    names = sorted(tensors)
    shards = {"a.safetensors": names, "b.safetensors": ["model.norm.weight"]}
    _split_into_shards(path, shards, index=False)
    with pytest.raises(CheckpointError, match=r"stores tensors more than once: model.norm.weight \(in a.safetensors, "
                                              r"b.safetensors\)"):
        load_model(path)


def test_an_index_that_contradicts_its_files_is_named(copy_of):
    path = copy_of()
    tensors = load_file(os.path.join(path, "model.safetensors"))
    names = sorted(tensors)
    shards = {"a.safetensors": names[:-1], "b.safetensors": names[-1:]}
    wrong = {"weight_map": {k: "a.safetensors" for k in names}}
    _split_into_shards(path, shards, index=wrong)
    with pytest.raises(CheckpointError, match=rf"not where the index says: {names[-1]} \(index: a.safetensors, "
                                              r"stored in: no file\)"):
        load_model(path)


@pytest.mark.parametrize("index, match", [
    ("{not json", "model.safetensors.index.json is not valid JSON"),
    ({"metadata": {}}, "has no 'weight_map' object"),
    ({"weight_map": {"model.norm.weight": 7}}, "not safetensors file names: 'model.norm.weight': 7"),
    ({"weight_map": {"model.norm.weight": "missing.safetensors"}}, "lists 'missing.safetensors', which is not in"),
])
def test_malformed_index_is_named(copy_of, index, match):
    path = copy_of()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        f.write(index if isinstance(index, str) else json.dumps(index))
    with pytest.raises(CheckpointError, match=match):
        load_model(path)


@pytest.mark.parametrize("content", [b"\xff" * 8, b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": 1}      ", b""])
def test_malformed_safetensors_header_names_the_file(copy_of, content):
    path = copy_of()
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(content)
    with pytest.raises(CheckpointError, match=r"model.safetensors is not a valid safetensors file"):
        load_model(path)


@pytest.mark.parametrize("dtype", [np.int64, np.int8, np.bool_])
def test_integer_or_bool_weights_are_named(copy_of, dtype):
    path = copy_of()
    name = "model.layers.0.self_attn.k_proj.weight"

    def edit(t):
        t[name] = np.ones(t[name].shape, dtype)

    edit_tensors(path, edit)
    with pytest.raises(CheckpointError, match=rf"{name} \((I64|I8|BOOL); expected one of F16, BF16, F32, F64\)"):
        load_model(path)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_named(copy_of, bad):
    path = copy_of()
    name = "model.layers.1.mlp.down_proj.weight"

    def edit(t):
        t[name] = t[name].copy()
        t[name][3, 4] = bad

    edit_tensors(path, edit)
    with pytest.raises(CheckpointError, match=rf"NaN or Inf values .*{name} \(float32\)"):
        load_model(path)


def test_missing_unexpected_and_misshaped_tensors_are_named(copy_of):
    path = copy_of()

    def edit(t):
        t.pop("model.layers.1.mlp.up_proj.weight")
        t["model.layers.0.self_attn.mystery.weight"] = np.zeros((2,), np.float32)
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)

    edit_tensors(path, edit)
    with pytest.raises(CheckpointError) as info:
        load_model(path)
    message = str(info.value)
    assert "missing tensors: model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected tensors: model.layers.0.self_attn.mystery.weight" in message
    assert "model.layers.0.self_attn.k_proj.weight: checkpoint gives [8, 64], model expects [32, 64]" in message


# ---- tokenizer ------------------------------------------------------------------------------------


def test_malformed_tokenizer_file_is_named(copy_of):
    path = copy_of(tokenizer=True)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write("{broken")
    with pytest.raises(TokenizerUnavailableError, match="tokenizer files of .* could not be loaded"):
        LLM(path, **SMALL)


def test_remote_code_tokenizer_is_refused_and_never_run(copy_of, tmp_path):
    path = copy_of(tokenizer=True)
    marker = tmp_path / "marker"
    _plant_remote_code(path, marker)
    edit_json(path, "tokenizer_config.json", tokenizer_class="EvilTokenizer",
              auto_map={"AutoTokenizer": [None, "evil.EvilTokenizer"]})
    with pytest.raises(TokenizerUnavailableError, match="needs code shipped with the checkpoint.*never runs code"):
        LLM(path, **SMALL)
    assert not marker.exists()
    # Token ids still serve without the tokenizer.
    llm = LLM(path, skip_tokenizer_init=True, **SMALL)
    assert llm.tokenizer is None
    assert len(llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=2))[0].token_ids) == 2
    assert not marker.exists()


@pytest.fixture(scope="module")
def text_llm(templates):
    return LLM(templates("llama", tokenizer=True), **SMALL)


def test_chat_template_errors_are_request_errors(text_llm):
    good = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequestError, match="message 0 of conversation 0 must be a dict with a 'role'"):
        text_llm.chat([{"content": "no role"}])
    with pytest.raises(InvalidRequestError, match="must be a conversation"):
        text_llm.chat("hello")
    template = text_llm.tokenizer.chat_template
    try:
        text_llm.tokenizer.chat_template = "{{ raise_exception('only the system may speak') }}"
        with pytest.raises(InvalidRequestError, match="chat template failed on conversation 0.*only the system"):
            text_llm.chat(good)
        # Templates render in transformers' sandbox: no reaching into Python objects.
        text_llm.tokenizer.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
        with pytest.raises(InvalidRequestError, match="chat template failed.*SecurityError"):
            text_llm.chat(good)
    finally:
        text_llm.tokenizer.chat_template = template
    assert text_llm.chat(good, SamplingParams(max_tokens=2))[0].finish_reason == "length"


# ---- requests and sampling ------------------------------------------------------------------------

SAMPLING_CASES = [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "1"), ("temperature", True),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", "x"), ("top_p", None),
    ("top_k", -2), ("top_k", 1.5), ("top_k", True), ("top_k", "5"),
    ("min_p", -0.1), ("min_p", 2.0), ("min_p", None),
    ("seed", -1), ("seed", 2**32), ("seed", 1.0), ("seed", True),
    ("max_tokens", 0), ("max_tokens", 1.5), ("max_tokens", False),
    ("stop", ""), ("stop", [""]), ("stop", [1]), ("stop", 5),
    ("stop_token_ids", [-3]), ("stop_token_ids", ["a"]), ("stop_token_ids", [True]), ("stop_token_ids", 5),
    ("ignore_eos", "no"), ("ignore_eos", 1),
    ("logprobs", -1), ("logprobs", 1.5), ("logprobs", True),
    ("skip_special_tokens", "no"), ("skip_special_tokens", 0),
    ("n", 4), ("n", 0), ("n", True), ("n", None), ("best_of", 2), ("best_of", 1.0),
]


@pytest.mark.parametrize("field, value", SAMPLING_CASES, ids=[f"{f}={v!r}" for f, v in SAMPLING_CASES])
def test_sampling_params_are_checked_when_built(field, value):
    with pytest.raises(InvalidRequestError, match=rf"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_one_output_per_request_for_now():
    """vLLM's ``n`` and ``best_of`` are accepted at 1; more is refused with the way to get several."""
    assert (SamplingParams(n=np.int64(1), best_of=1).n, SamplingParams().best_of) == (1, None)
    with pytest.raises(InvalidRequestError, match=r"SamplingParams.n must be 1, got 4: jaxinfer serves one output per "
                                                  r"request for now; for k samples of a prompt, send it k times with "
                                                  r"different seeds"):
        SamplingParams(n=4)


def test_sampling_params_take_numpy_scalars():
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), seed=np.uint32(7), stop="x")
    assert (type(p.temperature), type(p.top_k), type(p.seed), p.stop) == (float, int, int, ["x"])


@pytest.fixture(scope="module")
def llm(templates):
    return LLM(templates("llama"), **SMALL)


def _assert_idle(llm):
    """Nothing queued, nothing running, every page free."""
    scheduler = llm.engine.scheduler
    assert not scheduler.has_work()
    assert scheduler.allocator.num_free == scheduler.allocator.num_pages


GOOD_PROMPT = [5, 6, 7]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

REQUEST_CASES = [
    ("top_k beyond the vocabulary", [5, 6], SamplingParams(top_k=10**12), r"SamplingParams.top_k must be at most "
                                                                          r"the vocabulary size \(259\)"),
    ("stop id outside the vocabulary", [5, 6], SamplingParams(stop_token_ids=[10**6]), r"stop_token_ids outside"),
    ("logprobs above the engine's most", [5, 6], SamplingParams(logprobs=50), r"logprobs=50 exceeds .*max_logprobs=5"),
    ("stop strings without a tokenizer", [5, 6], SamplingParams(stop=["x"]), r"stop strings need a tokenizer"),
    ("float ids", [5.0, 6.0], GREEDY, r"must hold integer token ids; it holds \[5.0, 6.0\] \(float\)"),
    ("bool ids", [True, 6], GREEDY, r"must hold integer token ids.*\(bool\)"),
    ("string ids", ["5", "6"], GREEDY, r"must hold integer token ids.*\(str\)"),
    ("float array", np.array([5.0, 6.0]), GREEDY, r"must be a 1-D array of integers, got float64"),
    ("nested ids", [[5, 6]], GREEDY, r"must hold integer token ids"),
    ("empty prompt", [], GREEDY, r"prompt is empty"),
    ("negative id", [1, -1], GREEDY, r"outside the vocabulary \[0, 259\): \[-1\]"),
    ("id beyond the vocabulary", [1, 2, 100000], GREEDY, r"outside the vocabulary"),
    ("prompt as long as max_model_len", [1] * 32, GREEDY, r"32 tokens; max_model_len is 32"),
]


@pytest.mark.parametrize("prompt, params, match", [c[1:] for c in REQUEST_CASES], ids=[c[0] for c in REQUEST_CASES])
def test_bad_request_is_refused_and_the_good_one_completes(llm, prompt, params, match):
    """Engine level (requests added one by one): the bad request is refused when it is made; the good
    request added before it completes in the same run. ``LLM.generate`` refuses the whole batch
    before queueing anything, and then serves the good request alone."""
    engine = llm.engine
    good = engine.make_request(GOOD_PROMPT, GREEDY)
    engine.add(good)
    with pytest.raises(InvalidRequestError, match=match):
        engine.make_request(prompt, params)
    engine.run([good])
    assert len(good.output_token_ids) == 4 and good.finish_reason == "length"
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(prompt_token_ids=[GOOD_PROMPT, prompt], sampling_params=[GREEDY, params])
    _assert_idle(llm)
    assert llm.generate(prompt_token_ids=[GOOD_PROMPT], sampling_params=GREEDY)[0].token_ids == good.output_token_ids


def test_prompts_as_vllm_users_write_them(llm, text_llm):
    ids = llm.generate(prompt_token_ids=[GOOD_PROMPT], sampling_params=GREEDY)[0].token_ids
    as_dict = llm.generate({"prompt_token_ids": GOOD_PROMPT}, GREEDY)
    as_list = llm.generate([{"prompt_token_ids": GOOD_PROMPT}, GOOD_PROMPT, np.array(GOOD_PROMPT)], GREEDY)
    assert [o.token_ids for o in as_dict + as_list] == [ids] * 4
    text = text_llm.generate("Hi", GREEDY)[0]
    assert text_llm.generate({"prompt": "Hi"}, GREEDY)[0].token_ids == text.token_ids
    for bad, match in (({"promt": "Hi"}, r"prompt 0 is a dict with keys \['promt'\]"),
                       ({"prompt": "Hi", "prompt_token_ids": [1]}, r"keys \['prompt', 'prompt_token_ids'\]"),
                       ([GOOD_PROMPT, 3.5], r"prompt 1 is a float")):
        with pytest.raises(InvalidRequestError, match=match):
            llm.generate(bad, GREEDY)
    with pytest.raises(TokenizerUnavailableError, match="without a tokenizer"):
        llm.generate({"prompt": "Hi"}, GREEDY)
    with pytest.raises(InvalidRequestError, match="sampling_params must be SamplingParams"):
        llm.generate([GOOD_PROMPT], {"temperature": 0})
    _assert_idle(llm)


def test_abort_takes_request_ids(llm):
    """An int or an iterable of ints; anything else is named (a string would iterate into characters).
    Unknown or finished ids are ignored."""
    engine = llm.engine
    request = engine.make_request(GOOD_PROMPT, GREEDY)
    engine.add(request)
    for bad, named in (("0", "'0'"), (True, "True"), (None, "None"), ([0, "x"], r"'x' \(in \[0, 'x'\]\)")):
        with pytest.raises(InvalidRequestError, match=rf"request id {named} is not an int: abort takes a request id"):
            llm.abort(bad)
    assert not request.finish_reason
    llm.abort([np.int64(request.request_id), 10**9])
    assert request.finish_reason == "abort"
    _assert_idle(llm)


def test_logprobs_zero_is_the_sampled_tokens_logprob(llm):
    """``logprobs=0`` returns the sampled token's log-probability alone, from the full log-softmax,
    whatever else shares the batch."""
    import jax

    params = SamplingParams(temperature=0.8, seed=3, max_tokens=5, ignore_eos=True, logprobs=0)
    others = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)
    out, _ = llm.generate(prompt_token_ids=[GOOD_PROMPT, [9, 10]], sampling_params=[params, others])
    alone = llm.generate(prompt_token_ids=[GOOD_PROMPT], sampling_params=params)[0]
    assert alone.token_ids == out.token_ids
    logits = llm.model.logits(GOOD_PROMPT + out.token_ids)
    full = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert list(entry) == [token]
        np.testing.assert_allclose(entry[token], full[len(GOOD_PROMPT) - 1 + i, token], atol=1e-5)
        np.testing.assert_allclose(alone.logprobs[i][token], entry[token], rtol=1e-5, atol=1e-6)  # other batch


# ---- engine options -------------------------------------------------------------------------------

@pytest.mark.parametrize("options, match", [
    (dict(max_num_seqs=0), r"EngineConfig.max_num_seqs must be an integer >= 1, got 0"),
    (dict(max_num_seqs=True), r"EngineConfig.max_num_seqs must be an integer"),
    (dict(page_size="16"), r"EngineConfig.page_size must be an integer"),
    (dict(num_pages=0), r"EngineConfig.num_pages must be an integer >= 1"),
    (dict(max_model_len=2.5), r"EngineConfig.max_model_len must be an integer"),
    (dict(kv_cache_memory_fraction=1.5), r"kv_cache_memory_fraction must be a finite number > 0 and <= 1"),
    (dict(max_logprobs=-1), r"EngineConfig.max_logprobs must be an integer >= 0"),
    (dict(strict="yes"), r"EngineConfig.strict must be true or false"),
    (dict(compilation_cache_dir=3), r"compilation_cache_dir must be a path string"),
    (dict(max_num_seqs=8, max_num_batched_tokens=4), r"max_num_batched_tokens \(4\) must be >= max_num_seqs"),
    (dict(strict=True, warmup=False), r"strict mode needs warmup=True"),
    (dict(max_model_len=64, page_size=8, num_pages=4), r"4 KV pages .*cannot hold one sequence of max_model_len=64"),
    (dict(max_model_len=65), r"max_model_len=65 exceeds the model's max_position_embeddings \(64\).*"
                             r"allow_long_max_model_len=True"),
    (dict(max_num_seq=4), r"unknown LLM options \['max_num_seq'\]"),
    (dict(page_size=10**6), r"EngineConfig.page_size=1000000 exceeds max_model_len=32: .*use a page_size <= 32"),
    (dict(max_model_len=None, page_size=128),  # max_model_len from the model (64), before the weights are read
     r"EngineConfig.page_size=128 exceeds max_model_len=64: .*use a page_size <= 64"),
    (dict(num_pages=2**28), r"num_pages=268435456 x page_size=8 = 2147483648 cache rows, which int32 indices"),
])
def test_bad_engine_options(templates, options, match):
    with pytest.raises(ConfigError, match=match):
        LLM(templates("llama"), **{**SMALL, **options})


def test_a_long_max_model_len_is_served_when_asked(templates):
    llm = LLM(templates("llama"), **{**SMALL, "max_model_len": 80, "allow_long_max_model_len": True})
    assert llm.engine.config.max_model_len == 80


def test_bad_dtype(templates):
    with pytest.raises(ConfigError, match="dtype 'int4' is not supported"):
        LLM(templates("llama"), dtype="int4", **SMALL)


def test_the_cache_must_fit_in_memory(templates, monkeypatch):
    """On CPU as on the GPU the KV cache is bounded by the memory available (host memory here): a
    default cache shrinks to fit, an explicit page count that cannot fit is refused before anything
    is allocated."""
    from jaxinfer.engine import engine as engine_module

    page_bytes = 2 * 2 * 8 * 2 * 16 * 4  # K and V, 2 layers, page of 8, 2 kv heads of 16, float32
    monkeypatch.setattr(engine_module.memory, "available_bytes", lambda device=None: 10 * page_bytes)
    with pytest.raises(ConfigError, match=r"num_pages=100 pages of .* GiB are available for the KV cache"):
        LLM(templates("llama"), **{**SMALL, "num_pages": 100})
    llm = LLM(templates("llama"), **{**SMALL, "max_model_len": 16})  # 2 sequences of 2 pages would take 4
    assert llm.engine.config.num_pages == 4
    with pytest.raises(ConfigError, match=r"5 KV pages \(.* GiB of memory available.*cannot hold one sequence"):
        LLM(templates("llama"), **{**SMALL, "max_model_len": 64, "kv_cache_memory_fraction": 0.5})


def test_default_cache_on_cpu_is_bounded_by_host_memory(templates):
    from jaxinfer.engine import memory

    available = memory.available_bytes()
    assert available is not None and available > 0
    llm = LLM(templates("llama"), **{**SMALL, "max_model_len": 64})
    assert llm.engine.layout.total_bytes <= available


# ---- generation defaults --------------------------------------------------------------------------


def test_defaults_come_from_generation_config(copy_of):
    path = copy_of()
    edit_json(path, "generation_config.json", do_sample=True, temperature=0.7, top_p=0.9)
    llm = LLM(path, **SMALL)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.0)
    edit_json(path, "generation_config.json", do_sample=False)
    llm = LLM(path, **SMALL)
    assert llm.get_default_sampling_params().temperature == 0  # HF's generate() is greedy without do_sample
    greedy = SamplingParams(temperature=0)
    assert llm.generate(prompt_token_ids=[GOOD_PROMPT])[0].token_ids == \
        llm.generate(prompt_token_ids=[GOOD_PROMPT], sampling_params=greedy)[0].token_ids
    edit_json(path, "generation_config.json", do_sample=True, temperature=-1.0)
    with pytest.raises(ConfigError, match="generation_config.json: temperature must be a finite number >= 0"):
        LLM(path, **SMALL)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        f.write("{oops")
    with pytest.raises(ConfigError, match="generation_config.json is not valid JSON"):
        LLM(path, **SMALL)


# ---- command line ---------------------------------------------------------------------------------


def test_cli_prints_user_errors_without_a_traceback(tmp_path, capsys):
    from jaxinfer.cli import main

    assert main(["make-tiny", str(tmp_path / "x"), "--family", "nonesuch"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown tiny family 'nonesuch'") and "Traceback" not in err
    assert main(["generate", "--model", str(tmp_path / "x"), "--temperature", "-1"]) == 2
    assert "SamplingParams.temperature" in capsys.readouterr().err
    assert main(["generate", "--prompt-ids", "1,x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err


def test_make_tiny_covers_every_served_family():
    from jaxinfer.registry import _BUILTIN_MODELS
    from jaxinfer.tiny import TINY_FAMILIES

    tiny = {_BUILTIN_MODELS[family["architectures"][0]] for family in TINY_FAMILIES.values()}
    assert set(_BUILTIN_MODELS.values()) <= tiny  # every implementation (aliases share one)


def test_generated_text_escapes_control_characters():
    from jaxinfer.cli import printable

    assert printable("ok\ttext\n") == "ok\ttext\n"
    assert printable("a\x1b[2Jb\x07\x9b") == "a\\x1b[2Jb\\x07\\x9b"
