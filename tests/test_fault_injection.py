"""An engine survives a failed step and an interrupt anywhere in ``generate``: the failed call's
requests end (``"error"``, or ``"abort"`` for an interrupt), no page or request is leaked, nothing is
served to a later call, and the next ``generate`` gives the tokens of a fresh engine."""

from __future__ import annotations

import random
import threading
import time

import jax
import pytest

from jaxinfer import LLM, SamplingParams
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
    monkeypatch.setattr(engine.runner, "_call", Trip(engine.runner._call, 1, RuntimeError("injected")))
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
        patch.setattr(runner, "_call", Trip(runner._call, at, error))
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
    slow_call = engine.runner._call

    def slowly(*args):  # a step long enough for the other thread to act within it
        time.sleep(0.05)
        return slow_call(*args)

    monkeypatch.setattr(engine.runner, "_call", slowly)
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
