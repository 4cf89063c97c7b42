"""The kernel registry: a kernel whose ``supports`` refuses a call is never chosen, forcing is public
and strict, choices are recorded per program."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM
from jaxinfer.errors import KernelNotSupportedError
from jaxinfer.kernels import registry

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


def test_the_engine_records_its_choices(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    llm = LLM(path, dtype="float32", max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, page_size=8,
              show_progress=False)
    choices = llm.engine.runner.kernel_choices
    assert choices and set(choices) == set(llm.engine.runner.compiled_keys)
    for ops in choices.values():  # the CPU: the references
        assert ops and all(names == ["reference"] for names in ops.values())
