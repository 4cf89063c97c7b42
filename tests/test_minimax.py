"""MiniMax-Text-01 (whole-model parity: tests/test_parity.py) and the engine over its lightning state
slots: greedy tokens as HF's under strict mode with more sequences than slots, a mixed sampling
workload, batching, chunked prefill and preemption; the configs refused (the RoPE rotates the whole
head whatever the partial factor says); the tiny checkpoint is an HF one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxinfer import LLM, load_model
from jaxinfer.errors import ConfigError
from tests.conftest import (assert_mixed_workload_runs, assert_serving_is_consistent,
                            assert_slots_handed_on_match_hf, random_prompts, strict_hybrid_engine)
from tests.families import MINIMAX


@pytest.fixture(scope="module")
def minimax(hf_checkpoint):
    return hf_checkpoint("minimax", **MINIMAX)


@pytest.fixture(scope="module")
def strict_engine(minimax):
    """Shapes as ``assert_serving_is_consistent``'s first engine: its compiles are then cache reads."""
    path, _ = minimax
    return strict_hybrid_engine(path)


def test_greedy_tokens_match_hf_with_slots_handed_on(minimax, strict_engine):
    assert_slots_handed_on_match_hf(strict_engine, minimax[1])


def test_mixed_sampling_workload_under_strict_mode(strict_engine):
    assert_mixed_workload_runs(strict_engine)


def test_batched_chunked_and_preempted_equal_one_at_a_time(minimax):
    path, _ = minimax
    tight = assert_serving_is_consistent(path)
    assert tight.engine.scheduler.slots.num_free == tight.engine.layout.num_slots


def test_state_bytes_per_sequence(minimax):
    """Two lightning layers keep a float32 4 x 16 x 16 state per sequence (no conv state); the
    attention layer alone is paged."""
    path, _ = minimax
    layout = LLM(path, dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, page_size=8,
                 warmup=False, show_progress=False).engine.layout
    assert layout.bytes_per_slot == 2 * 4 * 16 * 16 * 4
    # Per token: the attention layer's k and v, 2 KV heads of 16.
    assert layout.bytes_by_kind()["PagedKV"] == (2 * 2 * 16 * 4, 0)


@pytest.mark.parametrize("overrides, message", [
    (dict(layer_types=["linear_attention", "sliding_attention"]),
     r"layer_types holds 'sliding_attention'; minimax layers are"),
    (dict(num_experts_per_tok=9), r"num_experts_per_tok must be an integer >= 1 and <= 8, got 9"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0, "partial_rotary_factor": 0.5}),
     r"rope type 'linear' with partial_rotary_factor 0.5: minimax attention rotates the whole head_dim"),
])
def test_bad_configs_are_specific_errors(overrides, message):
    """What the loader checks before anything is allocated (HF's config class accepts all three)."""
    from jaxinfer.config import ModelConfig
    from jaxinfer.models.minimax import MiniMaxForCausalLM
    from jaxinfer.tiny import tiny_config

    config = ModelConfig.from_dict(tiny_config("minimax", **overrides))
    with pytest.raises(ConfigError, match=message):
        MiniMaxForCausalLM.validate_config(config)


def test_tiny_checkpoint_is_an_hf_checkpoint(tmp_path):
    """The project's own tiny MiniMax checkpoint, written without HF's decay buffers (HF derives them
    on load), gives transformers the same logits as here."""
    import transformers

    from jaxinfer.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path, "minimax", with_tokenizer=False)
    ids = random_prompts([20], vocab_size=259, seed=3)[0]
    hf_model = transformers.MiniMaxForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(load_model(path, dtype="float32").logits(ids), ref, atol=1e-4, rtol=0)
