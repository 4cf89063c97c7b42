"""Engine behaviour: batching, paging, preemption, stop conditions, strict AOT mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, CompilationAfterWarmupError, SamplingParams
from jaxinfer.engine.aot import CompileGuard
from tests.conftest import assert_same_greedy_tokens, random_prompts

SMALL = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, page_size=8,
             show_progress=False)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# Lengths straddle page boundaries (page_size 8) and exceed one mixed-step budget (32 tokens).
LENGTHS = [3, 8, 9, 17, 40]


@pytest.fixture(scope="module")
def strict_llm(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    return LLM(path, strict=True, **SMALL)


def _one_at_a_time(llm, prompts, params):
    return [llm.generate(prompt_token_ids=[p], sampling_params=params)[0].token_ids for p in prompts]


def _next_logits(llm):
    return lambda ids: llm.model.logits(ids)[-1]


def test_batched_equals_one_at_a_time_greedy(strict_llm):
    prompts = random_prompts(LENGTHS, seed=3)
    batched = [o.token_ids for o in strict_llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    assert_same_greedy_tokens(batched, _one_at_a_time(strict_llm, prompts, GREEDY), prompts, _next_logits(strict_llm))
    assert all(len(t) == 12 for t in batched)


def test_seeded_sampling_is_batch_invariant(strict_llm):
    prompts = random_prompts(LENGTHS, seed=4)
    params = [SamplingParams(temperature=0.9, top_p=0.8, top_k=50, seed=i, max_tokens=10, ignore_eos=True)
              for i in range(len(prompts))]
    batched = [o.token_ids for o in strict_llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    alone = [strict_llm.generate(prompt_token_ids=[p], sampling_params=sp)[0].token_ids
             for p, sp in zip(prompts, params)]
    # Exact: batched logits differ from the lone ones in their last bits at most, which changes a
    # draw only where its uniform falls within that of a boundary of the cumulative probabilities.
    assert batched == alone
    other_seed = strict_llm.generate(prompt_token_ids=[prompts[0]], sampling_params=SamplingParams(
        temperature=0.9, top_p=0.8, top_k=50, seed=99, max_tokens=10, ignore_eos=True))[0].token_ids
    assert other_seed != batched[0]


def test_mixed_workload_under_strict_mode(strict_llm):
    """Many requests with different lengths and sampling settings: more than max_num_seqs at once,
    chunked prefills next to decodes; strict mode raises on any compile after warm-up."""
    prompts = random_prompts([5, 33, 12, 2, 47, 9, 20, 1, 30], seed=5)
    params = [SamplingParams(temperature=t, max_tokens=m, seed=1, ignore_eos=True, logprobs=2 if t else None)
              for t, m in zip([0, 0.7, 1.0, 0, 0.5, 0, 1.2, 0, 0.3], [3, 16, 8, 17, 9, 1, 12, 5, 30])]
    outs = strict_llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for prompt, sp, out in zip(prompts, params, outs):
        assert len(out.token_ids) == min(sp.max_tokens, 64 - len(prompt))
        assert out.finish_reason == "length"
        assert (out.logprobs is None) == (sp.logprobs is None)
        if out.logprobs:
            assert len(out.logprobs) == len(out.token_ids)
            assert all(tok in lp for tok, lp in zip(out.token_ids, out.logprobs))


def test_strict_mode_refuses_a_key_outside_the_grid(strict_llm):
    runner = strict_llm.engine.runner
    key = runner.compiled_keys[0]
    executable = runner._executables.pop(key)
    try:
        with pytest.raises(CompilationAfterWarmupError):
            runner.call(key, runner.example_inputs(key))
    finally:
        runner._executables[key] = executable


def test_runner_compiles_with_its_compiler_options(strict_llm):
    """The runner's XLA options reach the compiler: XLA refuses an invalid one."""
    runner = strict_llm.engine.runner
    key = runner.compiled_keys[0]
    executable = runner.executable(key)
    runner.compiler_options = {"xla_gpu_enable_command_buffer": "NOT_A_COMMAND"}
    try:
        with pytest.raises(jax.errors.JaxRuntimeError, match="not a valid enum value"):
            runner.compile(key)
    finally:
        runner.compiler_options = {}
        runner.add_executable(key, executable)


def test_all_greedy_batches_take_the_greedy_loop(hf_checkpoint, strict_llm, monkeypatch):
    """The decode loop samples with the argmax alone exactly when every row is greedy. A sampler that
    marks its all-greedy calls (token 7) shows which loop ran; a batch with a sampling row must give
    the tokens of the unmarked engine."""
    from jaxinfer.engine import runner as runner_module
    from jaxinfer.engine import sampling

    def marking_sampler(logits, batch, num_logprobs=None, all_greedy=False):
        tokens, logprobs = sampling.sample(logits, batch, num_logprobs, all_greedy)
        return (jnp.full_like(tokens, 7) if all_greedy else tokens), logprobs

    monkeypatch.setattr(runner_module, "sample", marking_sampler)
    path, _ = hf_checkpoint("llama")
    marked = LLM(path, warmup=False, **SMALL)
    prompts = random_prompts([7, 19], seed=8)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True)
    alone = marked.generate(prompt_token_ids=[prompts[0]], sampling_params=greedy)[0].token_ids
    assert alone[1:] == [7] * 5  # the first token comes from the prefill step
    mixed = [o.token_ids for o in marked.generate(prompt_token_ids=prompts, sampling_params=[greedy, sampled])]
    assert mixed == [o.token_ids for o in strict_llm.generate(prompt_token_ids=prompts,
                                                               sampling_params=[greedy, sampled])]
    assert mixed[0][1:] != [7] * 5


def test_greedy_tokens_and_logprobs_do_not_depend_on_the_batch_sampling(strict_llm):
    """A greedy request gets the same tokens and logprobs from the all-greedy loop (next to another
    greedy request) as from the full sampler's loop (next to a sampling request): same shapes, same
    forward, only the sampler differs (in another program: the logits may differ in their last bits)."""
    prompts = random_prompts([7, 19], seed=9)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=1, max_tokens=10, ignore_eos=True, logprobs=3)
    all_greedy = strict_llm.generate(prompt_token_ids=prompts, sampling_params=[greedy, greedy])[0]
    mixed = strict_llm.generate(prompt_token_ids=prompts, sampling_params=[greedy, sampled])[0]
    assert_same_greedy_tokens([all_greedy.token_ids], [mixed.token_ids], prompts[:1], _next_logits(strict_llm))
    tokens = list(zip(all_greedy.token_ids, mixed.token_ids))
    same = next((i for i, (a, b) in enumerate(tokens) if a != b), len(tokens))
    for got, want in zip(all_greedy.logprobs[:same], mixed.logprobs[:same]):
        assert list(got) == list(want)
        np.testing.assert_allclose(list(got.values()), list(want.values()), rtol=1e-5, atol=1e-6)


def test_request_token_ranges_cross_from_prompt_to_output():
    """A preempted request recomputes prompt and outputs: its chunks may start in one and end in the other."""
    from jaxinfer.engine.request import Request

    r = Request(0, [10, 11, 12], SamplingParams(), seed=0, stop_ids=(), max_output_tokens=4, output_token_ids=[20, 21])
    everything = [10, 11, 12, 20, 21]
    for start in range(6):
        for stop in range(start, 6):
            assert r.tokens(start, stop) == everything[start:stop] == [r.token_at(i) for i in range(start, stop)]


def test_compile_guard_catches_tracing():
    with pytest.raises(CompilationAfterWarmupError):
        with CompileGuard.get().serving():
            jax.jit(lambda x: x * 3 + 1)(jnp.ones(3))


def test_preemption_gives_the_same_tokens(hf_checkpoint, strict_llm):
    """With only 10 pages for 4 sequences of up to 8 pages each, requests get preempted and
    recomputed; greedy outputs must not change."""
    path, _ = hf_checkpoint("llama")
    tight = LLM(path, warmup=False, num_pages=10, **{k: v for k, v in SMALL.items()})
    prompts = random_prompts([30, 25, 28, 20], seed=6)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs = tight.generate(prompt_token_ids=prompts, sampling_params=params)
    assert tight.engine.scheduler.running == []
    assert_same_greedy_tokens([o.token_ids for o in outs], _one_at_a_time(strict_llm, prompts, params), prompts,
                              _next_logits(strict_llm))
    assert tight.engine.scheduler.allocator.num_free == 10


def test_preemption_actually_happens(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    tight = LLM(path, warmup=False, num_pages=10, **SMALL)
    prompts = random_prompts([30, 25, 28, 20], seed=6)
    requests = [tight.engine.make_request(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
                for p in prompts]
    for r in requests:
        tight.engine.add(r)
    tight.engine.run(requests)
    assert sum(r.num_preemptions for r in requests) > 0
    assert all(len(r.output_token_ids) == 30 for r in requests)


def test_stop_token_ids_and_eos(strict_llm):
    prompt = random_prompts([10], seed=7)[0]
    free = strict_llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0].token_ids
    stop_at = free[4]
    first = free.index(stop_at)
    out = strict_llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop"
    # The checkpoint's EOS (from generation_config.json) stops generation unless ignore_eos.
    eos = strict_llm.engine.eos_token_ids
    assert eos
    strict_llm.engine.eos_token_ids = (stop_at,)
    try:
        out = strict_llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=12))[0]
    finally:
        strict_llm.engine.eos_token_ids = eos
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop"


def test_generation_stops_at_max_model_len(strict_llm):
    prompt = random_prompts([60], seed=8)[0]
    out = strict_llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_text_prompts_stop_strings_and_chat(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, warmup=False, **SMALL)
    free = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert free.prompt_token_ids == llm.tokenizer.encode("Hello there")
    assert free.text == llm.tokenizer.decode(free.token_ids, skip_special_tokens=True)
    stop = free.text[3:5]
    assert stop, "the tiny model produced too little text for this test"
    out = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.find(stop)]
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=4))[0]
    expected_prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                        tokenize=True, return_dict=False)
    assert chat.prompt_token_ids == list(expected_prompt)


def test_pages_that_slid_out_of_the_window_go_back(hf_checkpoint, monkeypatch):
    """Mistral slides every layer: once decoding, a sequence holds at most the pages its window and
    one decode loop's new tokens span, and its tokens are HF's."""
    import torch

    from jaxinfer.engine.scheduler import DecodeBatch

    window, steps = 8, 4
    path, hf_model = hf_checkpoint("mistral", sliding_window=window)
    llm = LLM(path, warmup=False, decode_steps=steps, **SMALL)
    scheduler = llm.engine.scheduler
    assert scheduler.window == window
    held = []
    schedule = scheduler.schedule

    def recording():
        batch = schedule()
        if isinstance(batch, DecodeBatch):
            held.extend(len(r.pages) - r.num_released_pages for r in batch.requests)
        return batch

    monkeypatch.setattr(scheduler, "schedule", recording)
    prompts = random_prompts([5, 30], seed=12)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=30,
                                                                                 ignore_eos=True))
    page_size = SMALL["page_size"]
    assert held and max(held) <= -(-(window - 1 + steps) // page_size) + 1
    assert scheduler.allocator.num_free == scheduler.allocator.num_pages
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=30, min_new_tokens=30, do_sample=False,
                                    pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist()


def test_stop_strings_are_searched_in_the_new_text_only(tiny_llama_dir, monkeypatch):
    """Each new token decodes a short window, not the whole output: a request's stop checks cost
    O(its length). The one decode of the whole output is the final text's."""
    llm = LLM(tiny_llama_dir, warmup=False, **SMALL)
    lengths = []
    decode = llm.tokenizer.decode

    def recording(ids, **kwargs):
        lengths.append(len(ids))
        return decode(ids, **kwargs)

    monkeypatch.setattr(llm.tokenizer, "decode", recording)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=["never in random text \x00"])
    out = llm.generate("Hello", params)[0]
    assert len(out.token_ids) == 40 and out.finish_reason == "length"
    assert lengths.count(40) == 1 and sorted(lengths)[-2] <= 8
    assert out.text == decode(out.token_ids, skip_special_tokens=True)


def test_incremental_detokenizer_waits_for_whole_characters_and_finds_straddling_stops(tiny_llama_dir):
    from jaxinfer.engine.detokenizer import IncrementalDetokenizer
    from jaxinfer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_llama_dir)  # byte level: "é" is two tokens
    ids = tokenizer.encode("aé stop here", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, True, ["op h"])
    texts, stopped = [], False
    for n in range(1, len(ids) + 1):
        stopped = detok.add(ids[:n])
        texts.append(detok.text)
        if stopped:
            break
    assert texts[:3] == ["a", "a", "aé"]  # nothing emitted for half a character
    assert stopped and detok.text == "aé st"


def test_a_second_llm_reads_the_compilation_cache(hf_checkpoint):
    """LLM uses the persistent compilation cache by default, so a second LLM(...) of the same model
    and options in a process (a notebook's second cell) compiles nothing."""
    path, _ = hf_checkpoint("llama")
    options = {**SMALL, "max_model_len": 16, "max_num_seqs": 1, "max_num_batched_tokens": 16}
    LLM(path, **options)
    with CompileGuard.get().counting() as compiles:
        LLM(path, **options)
    assert compiles() == 0


def test_persistent_compilation_cache(tmp_path, hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    cache_dir = tmp_path / "xla-cache"
    options = {**SMALL, "max_model_len": 16, "max_num_seqs": 1, "max_num_batched_tokens": 16}
    from jax.experimental.compilation_cache import compilation_cache

    try:
        LLM(path, compilation_cache_dir=str(cache_dir), **options)
        assert any(cache_dir.iterdir())
    finally:
        compilation_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", None)


