"""The kernel registry: a kernel whose ``supports`` refuses a call is never chosen, forcing is public
and strict, choices are recorded per program; the per-call kernel context hands out unique flags
and carries faults, which end the step with ``KernelFaultError``."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.errors import KernelFaultError, KernelNotSupportedError
from jaxinfer.kernels import moe as moe_ops
from jaxinfer.kernels import registry
from jaxinfer.kernels.context import FLAGS_PER_KERNEL, KERNELS_PER_CALL, KernelContext
from jaxinfer.kernels.moe import reference as moe_reference
from tests.conftest import random_prompts

GPU = registry.Target(platform="gpu", device_kind="NVIDIA H200", compute_capability="9.0", sm_count=132)


@pytest.fixture(autouse=True)
def no_test_ops_left():
    before = set(registry.registered_ops())
    yield
    for name in set(registry.registered_ops()) - before:
        registry.unregister(name)


def _toy_op(calls: list):
    """``test.scale``: x * 2, with a kernel that takes only even sizes and one that takes none."""
    def kernel(name):
        def fn(x, *, interpret=False):
            calls.append((name, x.shape))
            return x * 2
        return fn

    return registry.Op("test.scale", lambda x: x * 2, (
        registry.Implementation("never", kernel("never"), supports=lambda t, x: False),
        registry.Implementation("even", kernel("even"), supports=lambda t, x: t.runs_pallas and x.size % 2 == 0),
    ))


def test_a_kernel_whose_supports_refuses_is_never_chosen():
    calls = []
    op = _toy_op(calls)
    for target in (GPU, registry.Target.interpreted(), registry.current_target()):
        for size in (1, 2, 3, 4):
            chosen = op.choose(target, jnp.ones(size))
            assert chosen.name != "never"
            assert chosen.name == ("even" if target.runs_pallas and size % 2 == 0 else "reference")
    with registry.targeting(GPU):
        np.testing.assert_array_equal(np.asarray(op(jnp.ones(3))), 2.0)  # the reference
        np.testing.assert_array_equal(np.asarray(op(jnp.ones(4))), 2.0)
    assert calls == [("even", (4,))]


def test_supports_are_asked_with_the_call():
    seen = []
    op = registry.Op("test.seen", lambda x, *, k=0: x, (
        registry.Implementation("k", lambda x, *, k=0, interpret=False: x,
                                supports=lambda t, x, *, k=0: seen.append((x.shape, k)) or False),))
    op.choose(GPU, jnp.ones(3), k=5)
    assert seen == [((3,), 5)]


def test_force_is_strict_and_scoped():
    calls = []
    op = _toy_op(calls)
    with registry.targeting(GPU):
        with registry.force("test.scale", "even"):
            op(jnp.ones(2))
            with pytest.raises(KernelNotSupportedError, match=r"test.scale: the forced implementation 'even'"):
                op(jnp.ones(3))
        with registry.force("test", "reference"):  # a family
            op(jnp.ones(2))
        op(jnp.ones(2))  # the default again
    assert calls == [("even", (2,)), ("even", (2,))]
    with pytest.raises(ValueError, match="has no implementation 'odd'"):
        with registry.force("test.scale", "odd"):
            pass
    with pytest.raises(ValueError, match="no op or op family 'nothing'"):
        with registry.force({"nothing": "reference"}):
            pass


def test_variants_serve_an_op_with_the_callers_function():
    op = _toy_op([])
    with registry.variant("test.scale", lambda x, *, interpret: x * 3), registry.recording() as chosen:
        np.testing.assert_array_equal(np.asarray(op(jnp.ones(3))), 3.0)
    assert chosen == {"test.scale": {"variant"}}
    np.testing.assert_array_equal(np.asarray(op(jnp.ones(3))), 2.0)


def test_the_kernel_context_hands_out_a_flag_range_per_kernel():
    context = KernelContext(jnp.int32(3))
    words = lambda f: jnp.stack([f, f])  # noqa: E731
    first = [int(context.flag("a", words)[0]) for _ in range(3)]
    base = 3 * KERNELS_PER_CALL * FLAGS_PER_KERNEL
    assert first == [base, base + 1, base + 2]
    assert int(context.flag("b", words)[0]) == base + FLAGS_PER_KERNEL  # another kernel: its own range
    context.chain_flag("a", "handed on")
    assert context.flag("a", words) == "handed on"  # a chained call takes what its predecessor left
    assert int(context.flag("a", words)[0]) == base + 4  # and its number is counted
    assert not bool(context.any_fault())
    context.report_fault("b", jnp.array([False, True]))
    assert bool(context.any_fault()) and context.fault_sources == ("b",)
    rebuilt = KernelContext.tree_unflatten(*reversed(context.tree_flatten()))  # a new trace starts clean
    assert not bool(rebuilt.any_fault()) and int(rebuilt.flag("a", words)[0]) == base


def test_the_engine_records_its_choices(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    llm = LLM(path, dtype="float32", max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, page_size=8,
              show_progress=False)
    choices = llm.engine.runner.kernel_choices
    assert choices and set(choices) == set(llm.engine.runner.compiled_keys)
    for ops in choices.values():  # the CPU: the references
        assert ops and all(names == ["reference"] for names in ops.values())


@pytest.fixture(scope="module")
def faulty_moe_engine(hf_checkpoint):
    """A tiny Qwen3-MoE engine whose MoE blocks report a fault in the model call numbered 1000."""
    def faulty_block(*args, context=None, **options):
        if context is not None:  # (none when the model is traced for its parameter shapes)
            context.report_fault("test.faulty_block", context.call_id == 1000)
        return moe_reference.moe_block(*args, **options)

    path, _ = hf_checkpoint("qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                            head_dim=16, intermediate_size=48)
    small = dict(dtype="float32", max_model_len=48, max_num_seqs=2, max_num_batched_tokens=16, page_size=8,
                 show_progress=False, warmup=False)
    with registry.variant("moe.moe_block", faulty_block, pallas=False):
        llm = LLM(path, **small)
    return llm, LLM(path, **small)


def test_a_kernel_fault_ends_the_step_and_the_engine_serves_on(faulty_moe_engine):
    llm, clean = faulty_moe_engine
    prompts, params = random_prompts([5, 11], seed=3), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [o.token_ids for o in clean.generate(prompts, params)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected  # no call numbered 1000 yet
    runner = llm.engine.runner
    runner.next_call_id = 1000
    with pytest.raises(KernelFaultError, match="test.faulty_block reported a fault"):
        llm.generate(prompts, params)
    scheduler = llm.engine.scheduler
    assert not scheduler.running and not scheduler.waiting and scheduler.allocator.num_free == scheduler.allocator.num_pages
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected


def test_moe_block_op_without_a_context_runs_the_ops():
    x = jnp.ones((1, 2048), jnp.bfloat16)
    args = (x, x, jnp.ones(2048, jnp.bfloat16), jnp.zeros((128, 2048), jnp.bfloat16),
            jnp.zeros((128, 768, 2048), jnp.bfloat16), jnp.zeros((128, 768, 2048), jnp.bfloat16),
            jnp.zeros((128, 2048, 768), jnp.bfloat16))
    assert moe_ops.moe_block_op.choose(GPU, *args, eps=1e-6, top_k=8).name == "ops"
