"""Unit tests of the parts: registry, allocator, buckets, sampler, tiny checkpoints, CLI."""

from __future__ import annotations

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import EngineConfig, ModelRegistry, UnsupportedArchitectureError
from jaxinfer.cache.allocator import OutOfPagesError, PageAllocator
from jaxinfer.engine.aot import BucketGrid
from jaxinfer.engine.sampling import SamplingBatch, _filter_logits, sample, seed_key_data


def test_registry_lazy_and_external():
    module = types.ModuleType("external_models_pkg")

    class FooForCausalLM:
        pass

    module.FooForCausalLM = FooForCausalLM
    sys.modules["external_models_pkg"] = module
    ModelRegistry.register("FooForCausalLM", "external_models_pkg:FooForCausalLM")
    assert ModelRegistry.resolve("FooForCausalLM") is FooForCausalLM
    assert "FooForCausalLM" in ModelRegistry.supported_architectures()
    with pytest.raises(ValueError, match="package.module:Class"):
        ModelRegistry.register("Bar", "no_colon")
    with pytest.raises(UnsupportedArchitectureError, match="Supported: .*FooForCausalLM"):
        ModelRegistry.resolve("NopeForCausalLM")


def test_page_allocator():
    alloc = PageAllocator(4)
    a = alloc.allocate(3)
    assert sorted(a) == [0, 1, 2] and alloc.num_free == 1
    with pytest.raises(OutOfPagesError):
        alloc.allocate(2)
    alloc.free(a)
    assert alloc.num_free == 4 and sorted(alloc.allocate(4)) == [0, 1, 2, 3]


def test_default_grid():
    config = EngineConfig(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=512, page_size=16)
    grid = BucketGrid.from_config(config)
    assert grid.token_buckets == (16, 32, 64, 128, 256, 512)
    assert grid.seq_buckets == (1, 2, 4, 8)
    assert grid.page_buckets == (1, 4, 16, 32)  # decode block tables grow x4 (page_bucket_growth)
    assert len(grid.keys(config)) == 6 + 4 * 4


def _reference_filter(x, top_k, top_p, min_p):
    """Straightforward numpy version of temperature-scaled top-k -> top-p -> min-p."""
    order = np.argsort(-x, kind="stable")
    keep = np.zeros_like(x, bool)
    k = len(x) if top_k <= 0 else top_k
    kept = order[:k]
    p = np.exp(x[kept] - x[kept].max())
    p /= p.sum()
    cum = 0.0
    for idx, prob in zip(kept, p):
        if cum >= top_p:
            break
        keep[idx] = True
        cum += prob
    if min_p > 0:
        keep &= x >= x.max() + np.log(min_p)
    return keep


@pytest.mark.parametrize("top_k, top_p, min_p", [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.7, 0.0), (10, 0.5, 0.0),
                                                 (0, 1.0, 0.2), (8, 0.9, 0.05)])
def test_filter_matches_reference(top_k, top_p, min_p):
    x = np.random.RandomState(0).randn(3, 40).astype(np.float32) * 2
    out = np.asarray(_filter_logits(jnp.asarray(x), jnp.full(3, top_k), jnp.full(3, top_p, jnp.float32),
                                    jnp.full(3, min_p, jnp.float32)))
    for row in range(3):
        np.testing.assert_array_equal(np.isfinite(out[row]), _reference_filter(x[row], top_k, top_p, min_p))


_sample = jax.jit(sample, static_argnums=2)


def _batch(n, temperature, seed=0, counter=0, top_k=0, logprobs=False):
    return SamplingBatch(jnp.full(n, temperature, jnp.float32), jnp.full(n, top_k, jnp.int32),
                         jnp.ones(n, jnp.float32), jnp.zeros(n, jnp.float32),
                         jnp.asarray(np.stack([seed_key_data(seed)] * n)), jnp.full(n, counter, jnp.int32),
                         jnp.full(n, logprobs))


def test_sampler_greedy_and_seeded():
    logits = jnp.asarray(np.random.RandomState(1).randn(4, 50).astype(np.float32))
    tokens, _ = _sample(logits, _batch(4, 0.0), 0)
    np.testing.assert_array_equal(tokens, np.argmax(np.asarray(logits), -1))
    a, _ = _sample(logits, _batch(4, 1.0, seed=7), 0)
    b, _ = _sample(logits, _batch(4, 1.0, seed=7), 0)
    np.testing.assert_array_equal(a, b)
    rows = jnp.broadcast_to(logits[:1], (20, 50))
    draws, _ = _sample(rows, _batch(20, 1.0, seed=7).replace(counters=jnp.arange(20, dtype=jnp.int32)), 0)
    assert len(set(np.asarray(draws).tolist())) > 1  # each counter draws afresh
    assert seed_key_data(7).tolist() == jax.random.key_data(jax.random.PRNGKey(7)).tolist()


def test_sampler_top_k_one_is_greedy():
    logits = jnp.asarray(np.random.RandomState(2).randn(3, 30).astype(np.float32))
    tokens, _ = _sample(logits, _batch(3, 1.5, seed=3, top_k=1), 0)
    np.testing.assert_array_equal(tokens, np.argmax(np.asarray(logits), -1))


def test_sampler_distribution():
    logits = jnp.broadcast_to(jnp.log(jnp.asarray([[0.5, 0.3, 0.2]], jnp.float32)), (2000, 3))
    batch = _batch(2000, 1.0, seed=11).replace(counters=jnp.arange(2000, dtype=jnp.int32))
    draws = np.asarray(_sample(logits, batch, 0)[0])
    freq = np.bincount(draws, minlength=3) / len(draws)
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.2], atol=0.04)


def test_logprobs_are_log_softmax():
    logits = jnp.asarray(np.random.RandomState(3).randn(2, 20).astype(np.float32))
    tokens, (sampled, top_ids, top_values) = _sample(logits, _batch(2, 0.0, logprobs=True), 3)
    ref = np.asarray(jax.nn.log_softmax(logits, -1))
    np.testing.assert_allclose(top_values, np.sort(ref, -1)[:, ::-1][:, :3], rtol=1e-6)
    np.testing.assert_allclose(sampled, ref[np.arange(2), np.asarray(tokens)], rtol=1e-6)
    # Nobody asked: the computation is skipped.
    _, (sampled, _, top_values) = _sample(logits, _batch(2, 0.0, logprobs=False), 3)
    assert not np.asarray(sampled).any() and not np.asarray(top_values).any()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "minimax_m2", "gpt_oss", "deepseek_v3", "gemma3"])
def test_tiny_checkpoint_loads_in_transformers(tmp_path, family):
    import torch
    from transformers import AutoModelForCausalLM

    from jaxinfer import load_model
    from jaxinfer.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / family, family)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = [1, 50, 60, 70, 80]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(load_model(path).logits(ids), ref, atol=1e-4)


def test_cli_generate_and_info(tmp_path, monkeypatch, capsys):
    from jaxinfer.cli import main

    monkeypatch.setenv("JAXINFER_HOME", str(tmp_path))
    assert main(["generate", "--prompt", "Hi", "--max-tokens", "3", "--max-model-len", "32", "--max-num-seqs", "1",
                 "--max-num-batched-tokens", "16", "--json", "--strict", "--no-compilation-cache"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and '"finish_reason": "length"' in out[0]
    assert main(["info", "-v", "--max-model-len", "32"]) == 0
    info = capsys.readouterr().out
    assert "LlamaForCausalLM" in info and "compile buckets:" in info and "decode(tokens=1, seqs=1, pages=1)" in info
    assert main(["generate", "--model", str(tmp_path / "nowhere")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_reading_a_config_leaves_the_callers_dict_alone():
    """transformers' config classes edit nested dicts (rope_parameters) in place; ours reads a copy,
    so one config read cannot leak into the next."""
    import copy

    from jaxinfer.config import ModelConfig
    from jaxinfer.tiny import tiny_config

    raw = tiny_config("minimax_m2")
    before = copy.deepcopy(raw)
    assert ModelConfig.from_dict(raw).rope.partial_rotary_factor == 0.5
    assert raw == before and "partial_rotary_factor" not in tiny_config("gpt_oss")["rope_parameters"]
