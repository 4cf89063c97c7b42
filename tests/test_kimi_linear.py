"""Kimi-Linear (KDA + NoPE MLA, DeepSeek-style MoE; whole-model parity: tests/test_parity.py): its
layers as HF builds them, and the engine over its state slots: greedy tokens as HF's under strict
mode with more sequences than slots (slots handed to new sequences), a mixed sampling workload,
batching, chunked prefill and preemption; the hub's original name for the dense MLP loads too."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxinfer import load_model
from jaxinfer.errors import ConfigError
from tests.conftest import (assert_mixed_workload_runs, assert_serving_is_consistent, assert_slots_handed_on_match_hf,
                            strict_hybrid_engine)
from tests.families import KIMI_LINEAR as CONFIG


@pytest.fixture(scope="module")
def kimi(hf_checkpoint):
    return hf_checkpoint("kimi_linear", **CONFIG)


@pytest.fixture(scope="module")
def strict_engine(kimi):
    """Four state slots, the grid of ``assert_serving_is_consistent``'s first engine: its programs are
    then read from the compilation cache, not compiled again."""
    path, _ = kimi
    return strict_hybrid_engine(path)


def test_layers_are_those_hf_builds(kimi):
    """The hub's 1-indexed lists (KDA 1, 3; MLA 2) and the dense first layer, as HF builds them."""
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention, KimiLinearMoE

    from jaxinfer.config import ModelConfig
    from jaxinfer.models.kimi_linear import KimiLinearForCausalLM

    path, hf_model = kimi
    ours = [(type(layer.mixer).__name__, type(layer.ffn).__name__)
            for layer in KimiLinearForCausalLM.spec(ModelConfig.from_pretrained(path)).layers]
    theirs = [("KDA" if isinstance(layer.self_attn, KimiLinearDeltaAttention) else "MLA",
               "MoESpec" if isinstance(layer.mlp, KimiLinearMoE) else "DenseMLP") for layer in hf_model.model.layers]
    assert ours == theirs == [("KDA", "DenseMLP"), ("MLA", "MoESpec"), ("KDA", "MoESpec")]


def test_hub_name_of_the_dense_mlp_loads(tmp_path, kimi):
    """The hub's original checkpoints keep the dense layer's MLP as ``mlp.*`` (transformers saves it
    as ``block_sparse_moe.*``); both load to the same parameters."""
    import shutil

    from flax import traverse_util

    path, _ = kimi
    hub = tmp_path / "hub-names"
    shutil.copytree(path, hub)
    tensors = load_file(hub / "model.safetensors")
    renamed = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v for k, v in tensors.items()}
    assert sorted(set(renamed) - set(tensors)) == [f"model.layers.0.mlp.{n}_proj.weight" for n in ("down", "gate", "up")]
    save_file(renamed, hub / "model.safetensors", metadata={"format": "pt"})
    ours, theirs = (traverse_util.flatten_dict(load_model(p, dtype="float32").params) for p in (path, str(hub)))
    assert ours.keys() == theirs.keys()
    for name in ours:
        np.testing.assert_array_equal(np.asarray(ours[name]), np.asarray(theirs[name]), err_msg=str(name))


def test_greedy_tokens_match_hf_with_slots_handed_on(kimi, strict_engine):
    assert_slots_handed_on_match_hf(strict_engine, kimi[1])


def test_mixed_sampling_workload_under_strict_mode(strict_engine):
    assert_mixed_workload_runs(strict_engine)


def test_batched_chunked_and_preempted_equal_one_at_a_time(kimi):
    path, _ = kimi
    tight = assert_serving_is_consistent(path)
    assert tight.engine.scheduler.slots.num_free == tight.engine.layout.num_slots


def test_state_bytes_per_sequence(kimi, strict_engine):
    """Two KDA layers: conv state (3 inputs of 3 * 2 * 16 channels, float32 here) and the float32
    recurrent state 2 x 16 x 16, per sequence; the MLA layer alone is paged ([latent | k_rope])."""
    layout = strict_engine.engine.layout
    assert layout.bytes_per_slot == 2 * (3 * 96 * 4 + 2 * 16 * 16 * 4)
    assert layout.bytes_by_kind()["PagedLatent"][0] == (16 + 8) * 4


@pytest.mark.parametrize("overrides, message", [
    (dict(num_key_value_heads=2), r"num_key_value_heads \(2\) must equal num_attention_heads \(4\)"),
    (dict(hidden_act="gelu"), r"hidden_act 'gelu' is not supported by KDA's short convolutions"),
    (dict(linear_conv_kernel_dim=1), r"linear_conv_kernel_dim must be an integer >= 2, got 1"),
])
def test_bad_configs_are_specific_errors(tmp_path, kimi, overrides, message):
    """The checkpoint's config.json edited: refused by name before any weight is read."""
    import json
    import shutil

    path, _ = kimi
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    config = json.loads((bad / "config.json").read_text())
    config.update(overrides)
    config.pop("linear_attn_config", None)  # HF's class would read the conv width from it over the flat field
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        load_model(str(bad), dtype="float32")
