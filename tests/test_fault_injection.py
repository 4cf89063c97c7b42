"""An engine survives a failed step and an interrupt anywhere in ``generate``: the failed call's
requests end (``"error"``, or ``"abort"`` for an interrupt), no page or request is leaked, nothing is
served to a later call, and the next ``generate`` gives the tokens of a fresh engine."""

from __future__ import annotations

import random
import threading
import time

import jax
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.sampling import NONFINITE_TOKEN
from tests.conftest import random_prompts

SMALL = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, page_size=8,
             show_progress=False)
PROMPTS = random_prompts([3, 9, 17, 40, 6, 12], seed=11)
PARAMS = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
          SamplingParams(temperature=0.7, top_k=20, seed=9, max_tokens=9, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=11, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=1, max_tokens=8, ignore_eos=True)]


@pytest.fixture(scope="module")
def served(hf_checkpoint):
    """A warmed-up engine and the tokens it gave, fresh, for PROMPTS."""
    path, _ = hf_checkpoint("llama")
    llm = LLM(path, **SMALL)
    reference = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    return llm, reference


def assert_idle(llm):
    """No request left queued or running, every page free, the caches whole."""
    scheduler = llm.engine.scheduler
    assert not scheduler.waiting and not scheduler.running
    assert scheduler.allocator.num_free == scheduler.allocator.num_pages
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(llm.engine.runner.caches))


def assert_serves_like_new(llm, reference):
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == reference
    assert_idle(llm)


class Trip:
    """Calls ``fn``; the ``at``-th call raises ``error`` (before ``fn`` runs, or after it returned)."""

    def __init__(self, fn, at: int, error: BaseException, after: bool = False):
        self.fn, self.at, self.error, self.after, self.calls = fn, at, error, after, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at and not self.after:
            raise self.error
        out = self.fn(*args, **kwargs)
        if self.calls == self.at:
            raise self.error
        return out


def test_an_error_inside_a_step_ends_that_steps_requests_only(served, monkeypatch):
    """Requests added one by one: the step that fails takes its batch with it (finish_reason
    "error", the error recorded, pages freed); the requests still waiting are served afterwards,
    with the tokens a fresh engine gives them."""
    llm, reference = served
    engine = llm.engine
    requests = [engine.make_request(p, s) for p, s in zip(PROMPTS, PARAMS)]
    for r in requests:
        engine.add(r)
    monkeypatch.setattr(engine.runner, "call", Trip(engine.runner.call, 1, RuntimeError("injected")))
    with pytest.raises(RuntimeError, match="injected"):
        engine.run(requests)
    failed = [r for r in requests if r.finish_reason == "error"]
    assert len(failed) == 4 and all(r.error == "RuntimeError: injected" for r in failed)  # the first step's four
    monkeypatch.undo()
    rest = [r for r in requests if r not in failed]
    engine.run(rest)
    assert [r.output_token_ids for r in rest] == reference[4:]
    assert_idle(llm)
    assert_serves_like_new(llm, reference)


def test_a_failure_after_the_caches_were_consumed_remakes_them(served, monkeypatch):
    """The executable ran (consuming the donated caches) but the call failed before the new caches
    were stored: the caches are re-made, and serving goes on as new."""
    llm, reference = served
    runner = llm.engine.runner
    tripped = {key: Trip(exe, 1, RuntimeError("after the call"), after=True) for key, exe in runner._executables.items()}
    monkeypatch.setattr(runner, "_executables", tripped)
    with pytest.raises(RuntimeError, match="after the call"):
        llm.generate(PROMPTS, PARAMS)
    monkeypatch.undo()
    assert_idle(llm)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(runner.caches))
    assert_serves_like_new(llm, reference)


def test_running_requests_are_recomputed_when_the_caches_are_lost(served):
    """If the caches are gone while requests are running (a call consumed them and never handed new
    ones back), those requests are recomputed from their tokens: same tokens as a fresh engine."""
    llm, reference = served
    engine = llm.engine
    requests = [engine.make_request(p, s) for p, s in zip(PROMPTS, PARAMS)]
    for r in requests:
        engine.add(r)
    engine.step()
    engine.step()
    running = list(engine.scheduler.running)
    assert running and any(r.output_token_ids for r in running)
    for leaf in jax.tree.leaves(engine.runner.caches):
        leaf.delete()
    engine.runner._call_in_flight = True
    engine.run(requests)
    assert [r.output_token_ids for r in requests] == reference
    assert all(r.num_preemptions == 1 for r in running)
    assert_idle(llm)


POINTS = ("add", "schedule", "call", "executable", "append")


def _interrupt_at(llm, point: str, at: int, patch):
    engine, runner = llm.engine, llm.engine.runner
    error = KeyboardInterrupt()
    if point == "add":
        patch.setattr(engine, "add", Trip(engine.add, at, error))
    elif point == "schedule":  # after pages were allocated for the batch
        patch.setattr(engine.scheduler, "schedule", Trip(engine.scheduler.schedule, at, error, after=True))
    elif point == "call":  # inputs built, nothing run
        patch.setattr(runner, "call", Trip(runner.call, at, error))
    elif point == "executable":  # the caches consumed, the new ones not stored
        calls = [0]

        def tripping(exe):
            def call(*args):
                out = exe(*args)
                calls[0] += 1
                if calls[0] == at:
                    raise error
                return out
            return call

        patch.setattr(runner, "_executables", {key: tripping(exe) for key, exe in runner._executables.items()})
    else:  # "append": while the outputs of a call are being recorded
        patch.setattr(engine, "_append", Trip(engine._append, at, error))


def test_keyboard_interrupt_anywhere_in_generate_loses_nothing(served):
    llm, reference = served
    rng = random.Random(0)
    cases = [(point, rng.randint(1, 3)) for point in POINTS for _ in range(2)]
    for point, at in cases:
        with pytest.MonkeyPatch.context() as patch:
            _interrupt_at(llm, point, at, patch)
            with pytest.raises(KeyboardInterrupt):
                llm.generate(PROMPTS, PARAMS)
        assert not llm.engine.scheduler.waiting and not llm.engine.scheduler.running, (point, at)
        assert llm.engine.scheduler.allocator.num_free == llm.engine.scheduler.allocator.num_pages, (point, at)
        assert_serves_like_new(llm, reference)


def test_abort_from_another_thread(served, monkeypatch):
    """``LLM.abort`` while ``generate`` runs in another thread: the aborted requests come back with
    ``finish_reason="abort"`` and the tokens they had; the others complete."""
    llm, reference = served
    engine = llm.engine
    slow_call = engine.runner.call

    def slowly(*args):  # a step long enough for the other thread to act within it
        time.sleep(0.05)
        return slow_call(*args)

    monkeypatch.setattr(engine.runner, "call", slowly)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    def abort_first_running():
        while not engine.scheduler.running:
            time.sleep(0.001)
        llm.abort(engine.scheduler.running[0].request_id)

    thread = threading.Thread(target=abort_first_running)
    thread.start()
    outs = llm.generate(PROMPTS[:2], [long, PARAMS[1]])
    thread.join()
    assert outs[0].finish_reason == "abort" and len(outs[0].token_ids) < 40
    assert outs[1].finish_reason == "length" and outs[1].token_ids == reference[1]
    monkeypatch.undo()
    assert_serves_like_new(llm, reference)


def test_abort_a_waiting_request(served):
    llm, reference = served
    engine = llm.engine
    first, second = (engine.make_request(p, s) for p, s in zip(PROMPTS[:2], PARAMS[:2]))
    engine.add(first)
    engine.add(second)
    engine.abort([second.request_id, 10**9])  # unknown ids are ignored
    assert second.finish_reason == "abort" and not second.output_token_ids
    engine.run([first])
    assert first.output_token_ids == reference[0]
    assert_idle(llm)


# ---- logits that are not finite ----------------------------------------------------------------

def test_the_sampler_marks_rows_whose_logits_are_not_finite():
    """A NaN or a +Inf anywhere in a row, or nothing but -Inf, gives ``NONFINITE_TOKEN``, greedy or
    sampled; a single -Inf is a probability of 0. The finite rows' tokens and logprobs are those of
    the same rows sampled without the bad ones."""
    from jaxinfer.engine.sampling import SamplingBatch, sample

    rows, vocab = 6, 32
    clean = np.random.RandomState(0).randn(rows, vocab).astype(np.float32)
    logits = clean.copy()
    logits[1, 5], logits[2, 7], logits[3], logits[4, int(np.argmax(clean[4]))] = np.nan, np.inf, -np.inf, -np.inf
    bad = [1, 2, 3]
    for temperature, all_greedy in ((0.0, True), (0.0, False), (0.8, False)):
        batch = SamplingBatch(np.full(rows, temperature, np.float32), np.zeros(rows, np.int32),
                              np.ones(rows, np.float32), np.zeros(rows, np.float32), np.zeros((rows, 2), np.uint32),
                              np.arange(rows, dtype=np.int32), np.ones(rows, bool))
        run = jax.jit(sample, static_argnums=(2, 3))
        tokens, logprobs = jax.device_get(run(logits, batch, 2, all_greedy))
        fixed = clean.copy()
        fixed[4] = logits[4]
        want, want_logprobs = jax.device_get(run(fixed, batch, 2, all_greedy))
        keep = [0, 4, 5]
        assert (tokens[bad] == NONFINITE_TOKEN).all() and (tokens[keep] == want[keep]).all(), temperature
        assert tokens[4] != int(np.argmax(clean[4]))
        for got, ref in zip(logprobs, want_logprobs):
            np.testing.assert_array_equal(got[keep], ref[keep])


def test_attention_ignores_whatever_invisible_cache_rows_hold():
    """NaN / Inf in cache rows a query cannot see (past its sequence's end in its last page, pages
    of other sequences, the padding entries of a block table) change nothing: a page freed by a
    request whose activations overflowed is safe to hand to the next one."""
    from jaxinfer.kernels.attention import reference

    rng = np.random.RandomState(0)
    kv_heads, pages, page_size, d, heads = 2, 6, 4, 8, 4
    k_cache = rng.randn(kv_heads, pages, page_size, d).astype(np.float32)
    v_cache = rng.randn(kv_heads, pages, page_size, d).astype(np.float32)
    block_tables = np.array([[2, 3, 0], [4, 0, 0]], np.int32)  # the padding entries point at page 0
    seq_lens = np.array([6, 3], np.int32)
    dirty_k, dirty_v = k_cache.copy(), v_cache.copy()
    for cache, value in ((dirty_k, np.inf), (dirty_v, np.nan)):
        cache[:, 0] = value  # another sequence's page, read through the padding entries
        cache[:, 3, 2:] = value  # past sequence 0's end
        cache[:, 4, 3:] = value  # past sequence 1's end
    q = rng.randn(2, heads, d).astype(np.float32)
    decode = [reference.paged_decode_attention(q, kc, vc, block_tables, seq_lens, scale=0.3)
              for kc, vc in ((k_cache, v_cache), (dirty_k, dirty_v))]
    np.testing.assert_array_equal(*decode)
    positions, seq_ids = np.array([4, 5, 1, 2], np.int32), np.array([0, 0, 1, 1], np.int32)
    q = rng.randn(4, heads, d).astype(np.float32)
    ragged = [reference.ragged_paged_attention(q, kc, vc, positions, seq_ids, block_tables, seq_lens, scale=0.3,
                                               sliding_window=2)
              for kc, vc in ((k_cache, v_cache), (dirty_k, dirty_v))]
    np.testing.assert_array_equal(*ragged)
    assert np.isfinite(decode[0]).all() and np.isfinite(ragged[0]).all()


GEMMA = dict(head_dim=16, sliding_window=64, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def overflowing(hf_checkpoint, tmp_path_factory):
    """A Gemma 3 engine (float32) whose token ``bad`` has the finite embedding 3e38: Gemma scales
    embeddings by sqrt(hidden_size) = 8, so the token's hidden state is +Inf, then NaN, and so are
    the logits of any sequence that holds it. ``prompts``: four prompts without it; the greedy
    continuation of the first (``clean``, by transformers) makes it as its token ``at`` >= 2.
    -> (llm, bad, at, prompts, clean)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from tests.conftest import hf_greedy

    source, hf_model = hf_checkpoint("gemma3", **GEMMA)
    prompts = random_prompts([5, 7, 4, 6], seed=3)
    clean = [hf_greedy(hf_model, p, 8) for p in prompts]
    seen_elsewhere = {t for p in prompts for t in p} | {t for c in clean[1:] for t in c}
    at = next(i for i in range(2, 6) if clean[0][i] not in seen_elsewhere | set(clean[0][:i]))
    bad = clean[0][at]
    path = tmp_path_factory.mktemp("gemma3-overflowing") / "ckpt"
    shutil.copytree(source, path)
    weights = load_file(path / "model.safetensors")
    weights["model.embed_tokens.weight"][bad] = 3e38
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(path), warmup=False, **SMALL)
    return llm, bad, at, prompts, clean


def _alone(llm, prompts, params):
    return [llm.generate(prompt_token_ids=[p], sampling_params=s)[0].token_ids for p, s in zip(prompts, params)]


def test_a_request_whose_logits_are_not_finite_ends_with_an_error(overflowing, monkeypatch):
    """The request that reaches the token ends with "error" and says why, without the token it
    could not sample: in its prefill (a mixed step) and after some greedy tokens (in the decode loop,
    the all-greedy one and the sampling one); the requests beside it give the tokens they give
    alone, and so does the next call on the pages and slots it had."""
    llm, bad, at, prompts, clean = overflowing
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)
    decoded = []  # the decode loops' tokens
    run_decode = engine.runner.run_decode

    def spy(*args):
        out = run_decode(*args)
        decoded.append(out[0])
        return out

    monkeypatch.setattr(engine.runner, "run_decode", spy)
    params = [greedy, sampled, greedy, sampled]
    reference = _alone(llm, prompts[1:], params[1:])
    assert _alone(llm, prompts[:1], [greedy])[0] == clean[0][:at + 1]

    # In the prefill: the first request (pages 0 on, which every block table's padding points at).
    poisoned = prompts[0][:2] + [bad] + prompts[0][2:]
    outs = llm.generate(prompt_token_ids=[poisoned] + prompts[1:], sampling_params=[sampled] + params[1:])
    assert outs[0].finish_reason == "error" and outs[0].token_ids == []
    assert outs[0].error.startswith("the model's logits for generated token 1 were not finite (NaN or Inf): "
                                    "the computation overflowed float32's range")
    assert [o.token_ids for o in outs[1:]] == reference and all(o.error is None for o in outs[1:])
    assert_idle(llm)

    # In the decode loop, after `at` + 1 tokens: with the sampling loop, then the all-greedy one.
    for batch in (params, [greedy] * 4):
        decoded.clear()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=batch)
        assert outs[0].finish_reason == "error" and outs[0].token_ids == clean[0][:at + 1]
        assert f"logits for generated token {at + 2} were not finite" in outs[0].error
        steps, rows = np.nonzero(np.concatenate(decoded) == NONFINITE_TOKEN)
        assert len(rows) == 1 and (np.concatenate(decoded)[steps[0] + 1:, rows[0]] == -1).all()  # stopped there
        want = reference if batch is params else _alone(llm, prompts[1:], batch[1:])
        assert [o.token_ids for o in outs[1:]] == want
        assert_idle(llm)
    assert _alone(llm, prompts[1:], params[1:]) == reference


def test_the_cli_prints_the_error_and_exits_1(overflowing, monkeypatch, capsys):
    """``jaxinfer generate``: the failed prompt's output (none), then ``error: prompt N: ...`` on
    stderr (and ``"error"`` in ``--json``), exit status 1; the other prompt is served."""
    import json

    import jaxinfer
    from jaxinfer.cli import main

    llm, bad, _, prompts, _ = overflowing
    monkeypatch.setattr(jaxinfer, "LLM", lambda *args, **kwargs: llm)
    served = _alone(llm, prompts[2:3], [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)])[0]
    ids = [",".join(map(str, p)) for p in ([bad] + prompts[2][:2], prompts[2])]
    args = ["generate", "--model", "unused", "--temperature", "0", "--ignore-eos", "--max-tokens", "3",
            "--prompt-ids", ids[0], "--prompt-ids", ids[1]]
    assert main(args) == 1
    out, err = capsys.readouterr()
    assert out.splitlines() == ["[]", str(served)]
    assert err.startswith("error: prompt 1: the model's logits for generated token 1 were not finite (NaN or Inf)")
    assert main(args + ["--json"]) == 1
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["finish_reason"] == "error" and "were not finite" in lines[0]["error"]
    assert lines[1]["token_ids"] == served and lines[1]["error"] is None


def test_state_slots_and_pages_left_non_finite_are_safe_to_reuse(hf_checkpoint, monkeypatch):
    """A gated-DeltaNet hybrid served with ``A_log`` = 1e4 (decay -exp(1e4) = -Inf): every request
    ends with "error", and the caches it filled with NaN are re-made. Served right, shorter prompts on
    those slots and pages give the tokens they gave before."""
    from tests.families import HYBRID

    path, _ = hf_checkpoint("qwen3_5", **HYBRID)
    llm = LLM(path, warmup=False, **SMALL)
    greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    short = random_prompts([5, 4, 4, 5], seed=4)  # one prefill step, of the longer prompts' token bucket
    reference = [o.token_ids for o in llm.generate(prompt_token_ids=short, sampling_params=greedy)]
    params = llm.engine.model.params
    overflowing = jax.tree_util.tree_map_with_path(
        lambda where, x: x.at[...].set(1e4) if "A_log" in jax.tree_util.keystr(where) else x, params)
    monkeypatch.setattr(llm.engine.model, "params", overflowing)
    outs = llm.generate(prompt_token_ids=random_prompts([9, 8, 7, 6], seed=4), sampling_params=greedy)
    assert all(o.finish_reason == "error" and "were not finite" in o.error and not o.token_ids for o in outs)
    assert all(bool(np.isfinite(leaf).all()) for leaf in jax.tree.leaves(llm.engine.runner.caches))
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(prompt_token_ids=short, sampling_params=greedy)] == reference
    assert_idle(llm)
    assert llm.engine.scheduler.slots.num_free == llm.engine.layout.num_slots


def test_block_table_padding_points_at_the_sequences_own_pages(served):
    """Entries past a sequence's pages repeat its last page, so a kernel that reads a whole block of
    entries past its end reads rows of its own, never page 0's (another request's, maybe NaN)."""
    from jaxinfer.engine.aot import MIXED, CompileKey

    llm, _ = served
    engine = llm.engine
    requests = [engine.make_request(p, s) for p, s in zip(PROMPTS[:2], PARAMS[:2])]
    for r in requests:
        engine.add(r)
    batch = engine.scheduler.schedule()
    key = CompileKey(MIXED, engine.grid.token_buckets[-1], engine.config.max_num_seqs, engine.config.max_pages_per_seq)
    _, md, _ = engine.runner.mixed_inputs(key, batch.items)
    for row, (r, _) in enumerate(batch.items):
        table = np.asarray(md.block_tables[row])
        assert list(table[:len(r.pages)]) == r.pages and (table[len(r.pages):] == r.pages[-1]).all()
    assert all(len(r.pages) < key.pages_per_seq for r in requests)  # every row has padding entries
    engine.abort([r.request_id for r in requests])
    assert_idle(llm)
