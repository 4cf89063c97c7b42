"""Shared fixtures: tiny random HF checkpoints written with ``save_pretrained``."""

from __future__ import annotations

import os

# The tests' programs are tiny and each runs a few times, so their compile time is the suite's time:
# XLA's CPU backend compiles them without LLVM's optimisation passes (the same HLO, the same float
# semantics; no fast math either way), about a quarter less time. Set before any backend starts.
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0"]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# float32 parity needs float32 matmuls; GPUs would otherwise use TF32 (CPU is unaffected).
jax.config.update("jax_default_matmul_precision", "highest")

TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


@pytest.fixture(scope="session", autouse=True)
def jaxinfer_home(tmp_path_factory):
    """The engine's files (the persistent compilation cache, the CLI's tiny checkpoint) go to a folder
    of this test session, not the user's ~/.cache."""
    path = str(tmp_path_factory.mktemp("jaxinfer-home"))
    previous = os.environ.get("JAXINFER_HOME")
    os.environ["JAXINFER_HOME"] = path
    yield path
    if previous is None:
        os.environ.pop("JAXINFER_HOME", None)
    else:
        os.environ["JAXINFER_HOME"] = previous


def make_hf_checkpoint(path, family: str, seed: int = 0, **overrides):
    """Build a random HF model of ``family`` with torch, save it, return (path, model)."""
    import torch
    import transformers

    from tests.families import muse_glimmer_config

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "minimax_m2": (transformers.MiniMaxM2Config, transformers.MiniMaxM2ForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
        "deepseek_v32": (transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM),
        "glm_moe_dsa": (transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM),
        "hy_v4": (transformers.HYV4Config, transformers.HYV4ForCausalLM),
        "sarvam_mla": (transformers.SarvamMLAConfig, transformers.DeepseekV3ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
        "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
        "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
        "kimi_linear": (transformers.KimiLinearConfig, transformers.KimiLinearForCausalLM),
        "bailing_hybrid": (transformers.BailingHybridConfig, transformers.BailingHybridForCausalLM),
        "minimax": (transformers.MiniMaxConfig, transformers.MiniMaxForCausalLM),
        "muse_glimmer": (muse_glimmer_config, transformers.MuseGlimmerForConditionalGeneration),
    }
    config_cls, model_cls = classes[family]
    config = config_cls(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Random init leaves norms at 1, biases and router corrections at 0, and experts tiny; perturb
    # them so the parity test sees every one of them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "sinks", "hc.base", "hc.scale", "hc_base", "hc_scale")) or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
            if ".experts." in name and p.dim() >= 2:
                p.normal_(0.0, 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(0.1 * torch.randn_like(b))
    model.save_pretrained(path)
    return str(path), model


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    cache = {}

    def get(family: str, **overrides):
        key = (family, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            cache[key] = make_hf_checkpoint(tmp_path_factory.mktemp(family), family, **overrides)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """The project's own tiny checkpoint (with tokenizer), as the CLI default writes it."""
    from jaxinfer.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama", max_position_embeddings=128)


def random_prompts(lengths, vocab_size=160, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(3, vocab_size, size=n).tolist() for n in lengths]


def hf_greedy(hf_model, prompt, max_tokens=16):
    """HF ``generate``'s greedy continuation of ``prompt``, exactly ``max_tokens`` long. No EOS id is
    given: ``min_new_tokens`` would otherwise mask EOS out of the argmax, which our ``ignore_eos``
    does not do."""
    import torch

    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                                eos_token_id=None)
    assert out.shape[1] == len(prompt) + max_tokens
    return out[0, len(prompt):].tolist()


def hf_next_logits(hf_model):
    """``ids ->`` HF's float32 logits of the token after ``ids`` (for ``assert_same_greedy_tokens``)."""
    import torch

    def next_logits(ids):
        with torch.no_grad():
            return hf_model(torch.tensor([ids])).logits[0, -1].numpy()

    return next_logits


# Two float32 runs of one model in other batches, bucket shapes, programs or implementations give
# logits that differ in their last bits (about 1e-6; 1e-5 against HF), which can flip an argmax
# between two logits that close and no others.
NEAR_TIE = 1e-4


def assert_same_greedy_tokens(got, want, prompts, next_logits, near_tie=NEAR_TIE):
    """Greedy continuations of ``prompts`` (one list each) are equal, or part at a near tie: where
    they first differ, both tokens' logits (``next_logits(ids)``: those of the token after ``ids``)
    are within ``near_tie`` of the best. What follows is not compared: each continues its own text."""
    assert len(got) == len(want) == len(prompts)
    for prompt, g, w in zip(prompts, got, want):
        if list(g) == list(w):
            continue
        step = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None)
        assert step is not None, f"the greedy continuations of {prompt} differ in length: {g} vs {w}"
        logits = np.asarray(next_logits(list(prompt) + list(g[:step])), np.float32)
        best = float(logits.max())
        assert best - min(logits[g[step]], logits[w[step]]) <= near_tie, (
            f"the greedy continuations of {prompt} part at step {step} ({g[step]} vs {w[step]}) with no near tie: "
            f"their logits {logits[g[step]]:.6f} and {logits[w[step]]:.6f}, the best {best:.6f}")


def assert_greedy_matches_hf(path, hf_model, prompts, max_tokens=16, max_num_seqs=4):
    """Greedy tokens from our engine (float32, small buckets) equal HF ``generate``'s, prompt by prompt
    (up to a near tie: ``assert_same_greedy_tokens``)."""
    from jaxinfer import LLM, SamplingParams

    llm = LLM(path, dtype="float32", max_model_len=64, max_num_seqs=max_num_seqs, max_num_batched_tokens=32,
              page_size=8, warmup=False, show_progress=False)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                                 ignore_eos=True))
    assert_same_greedy_tokens([o.token_ids for o in outs], [hf_greedy(hf_model, p, max_tokens) for p in prompts],
                              prompts, hf_next_logits(hf_model))
    assert all(out.finish_reason == "length" for out in outs)


def assert_logits_and_greedy_match_hf(path, hf_model):
    """Full-forward float32 logits of a 40-token prompt within 1e-4 of HF's, and 16 greedy tokens of
    two prompts (9 and 26 tokens, served together) equal to HF ``generate``'s."""
    import numpy as np
    import torch

    from jaxinfer import load_model

    ids = random_prompts([40], seed=1)[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(load_model(path, dtype="float32").logits(ids), ref, atol=1e-4, rtol=0)
    assert_greedy_matches_hf(path, hf_model, random_prompts([9, 26], seed=2), max_num_seqs=2)


def strict_hybrid_engine(path):
    """A strict engine on the grid of ``assert_serving_is_consistent``'s first engine (whose programs
    are then read from the compilation cache, not compiled again), with four state slots."""
    from jaxinfer import LLM

    return LLM(path, dtype="float32", strict=True, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
               page_size=16, show_progress=False)


def assert_slots_handed_on_match_hf(llm, hf_model):
    """Six prompts over four state slots under strict mode: chunked prompts (16-token steps), decodes
    next to prefills, and slots freed by finished sequences handed to new ones; every sequence's 16
    greedy tokens equal HF ``generate``'s, and every slot is free again."""
    from jaxinfer import SamplingParams

    prompts = random_prompts([9, 26, 3, 40, 14, 21], seed=2)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=16,
                                                                                 ignore_eos=True))
    assert_same_greedy_tokens([o.token_ids for o in outs], [hf_greedy(hf_model, p) for p in prompts], prompts,
                              hf_next_logits(hf_model))
    assert llm.engine.scheduler.slots.num_free == llm.engine.layout.num_slots


def assert_mixed_workload_runs(llm):
    """Prompts and sampling settings of every kind, more requests than sequences at once (the engine
    is strict: nothing compiles); each output has its length, every slot is free again."""
    from jaxinfer import SamplingParams

    prompts = random_prompts([5, 33, 12, 2, 20, 1], seed=5)
    params = [SamplingParams(temperature=t, max_tokens=m, seed=1, ignore_eos=True)
              for t, m in zip([0, 0.7, 1.0, 0, 0.5, 0], [3, 16, 8, 17, 9, 1])]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [len(o.token_ids) for o in outs] == [min(p.max_tokens, 64 - len(x)) for p, x in zip(params, prompts)]
    assert llm.engine.scheduler.slots.num_free == llm.engine.layout.num_slots


def assert_serving_is_consistent(path):
    """Four prompts (3-40 tokens, greedy): batched == one at a time, chunked prefill (16-token steps)
    == one-shot, and preemption under a 5-page pool (the four need 9) gives the same tokens (up to a
    near tie: ``assert_same_greedy_tokens``). -> the tight engine."""
    from jaxinfer import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = random_prompts([3, 17, 40, 9], seed=5)
    small = dict(dtype="float32", max_model_len=64, page_size=16, show_progress=False, warmup=False)
    llm = LLM(path, max_num_seqs=4, max_num_batched_tokens=16, **small)  # 40 tokens: three chunks
    alone = [llm.generate(prompt_token_ids=[p], sampling_params=greedy)[0].token_ids for p in prompts]

    def same_as_alone(got):
        assert_same_greedy_tokens(got, alone, prompts, lambda ids: llm.model.logits(ids)[-1])

    same_as_alone([o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=greedy)])
    one_shot = LLM(path, max_num_seqs=4, max_num_batched_tokens=64, **small)
    same_as_alone([o.token_ids for o in one_shot.generate(prompt_token_ids=prompts, sampling_params=greedy)])
    tight = LLM(path, max_num_seqs=4, max_num_batched_tokens=16, num_pages=5, **small)
    engine = tight.engine
    requests = [engine.make_request(p, greedy) for p in prompts]
    for r in requests:
        engine.add(r)
    engine.run(requests)
    assert any(r.num_preemptions for r in requests)
    same_as_alone([r.output_token_ids for r in requests])
    return tight
