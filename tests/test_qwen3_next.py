"""The gated-DeltaNet hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) against transformers, and the
engine over their state slots: logits, greedy tokens, strict mode with a mixed workload whose
sequences outnumber the slots (slots handed to new sequences), batching, chunked prefill and
preemption; the two projection layouts are not interchangeable."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxinfer import LLM, load_model
from jaxinfer.errors import ConfigError
from tests.conftest import (assert_greedy_matches_hf, assert_mixed_workload_runs, assert_serving_is_consistent,
                            assert_slots_handed_on_match_hf, random_prompts, strict_hybrid_engine)

# A DeltaNet layer and a gated full-attention layer; 2 key heads feeding 4 value heads; partial RoPE.
HYBRID = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], head_dim=16,
              linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_conv_kernel_dim=4, initializer_range=0.1,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
FAMILIES = {
    "qwen3_next": dict(HYBRID, **MOE, decoder_sparse_step=2),  # a dense and a sparse layer
    "qwen3_5": HYBRID,
    "qwen3_5_moe": dict(HYBRID, **MOE),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, hf_checkpoint):
    path, hf_model = hf_checkpoint(request.param, **FAMILIES[request.param])
    return request.param, path, hf_model


@pytest.fixture(scope="module")
def strict_next(hf_checkpoint):
    """Qwen3-Next under strict mode, on the grid of ``assert_serving_is_consistent``'s first engine
    (whose programs are then read from the compilation cache, not compiled again). The three classes
    share the mixer and the state handling; Qwen3.5's own layout and layers are checked by the
    parity tests."""
    path, hf_model = hf_checkpoint("qwen3_next", **FAMILIES["qwen3_next"])
    return strict_hybrid_engine(path), hf_model


def test_logits_match_hf(family):
    _, path, hf_model = family
    ids = random_prompts([40], seed=1)[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(load_model(path, dtype="float32").logits(ids), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_greedy_tokens_match_hf(name, hf_checkpoint):
    assert_greedy_matches_hf(*hf_checkpoint(name, **FAMILIES[name]), random_prompts([9, 26], seed=2), max_num_seqs=2)


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
