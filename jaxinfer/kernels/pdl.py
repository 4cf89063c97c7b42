"""Early programmatic-dependent-launch triggers for the Pallas (Triton lowering) kernels.

On Hopper, XLA launches each kernel of a step with programmatic dependent launch (PDL) and starts every
kernel it compiles with ``griddepcontrol.wait``, which returns once the kernel before has finished and
its writes are visible. The next kernel may be launched (its programs placed on the SMs, up to that
wait) as soon as every program of the running kernel has executed ``griddepcontrol.launch_dependents``
or exited. XLA emits that trigger only in its own fusions, so after one of our kernels the next one is
launched when the last program exits, and the launch latency sits between the two.

``with_trigger(kernel, family)`` makes a kernel trigger first thing (after XLA's wait). The kernels of
the decode step do, in every call (at prefill sizes too): the next kernel's programs are placed while
this one runs, and wait on the SMs for it. That saves the launch latency, not more: the next kernel
still waits at its entry before it loads anything. Every family triggers at its start: the trigger
made the decode step faster, and leaving it out of single families made no measurable difference
(docs/performance.md, "Launch triggers (PDL)").

A trigger is not a memory fence and changes no value: the next kernel's wait still orders its reads
after this kernel's writes. Without PDL (another GPU, XLA's PDL off) the instruction does nothing;
under the interpreter (and so on CPU) nothing is emitted. ``trigger_points({...})`` sets the point
("start" or "none") of the kernels traced inside, to compare.
"""

from __future__ import annotations

import contextlib
import functools

import jax
from jax._src import core as jax_core
from jax._src import effects
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas import core as pallas_core
from jax._src.pallas.triton import lowering

POINTS = ("start", "none")  # "none": the next kernel launches as the last program exits

# The kernel families that trigger, each at its point.
DEFAULT_POINTS = {family: "start" for family in ("projection", "rms_norm", "decode_attention", "decode_combine",
                                                 "moe_route", "moe_gate_up", "moe_down")}

_points = dict(DEFAULT_POINTS)


class _TriggerEffect(jax_core.Effect):
    """Keeps the trigger alive through dead-code elimination (it has no output)."""


_trigger_effect = _TriggerEffect()
pallas_core.kernel_local_effects.add_type(_TriggerEffect)
effects.control_flow_allowed_effects.add_type(_TriggerEffect)

launch_dependents_p = jax_core.Primitive("launch_dependents")
launch_dependents_p.multiple_results = True


@launch_dependents_p.def_effectful_abstract_eval
def _abstract_eval():
    return (), {_trigger_effect}


@lowering.register_lowering(launch_dependents_p)
def _lowering(ctx):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    tt_dialect.elementwise_inline_asm([i32], "griddepcontrol.launch_dependents; mov.u32 $0, 0;", constraints="=r",
                                      pure=False, packed_element=1, args=[])
    return []


def _check_family(family: str):
    if family not in DEFAULT_POINTS:
        raise ValueError(f"unknown kernel family {family!r}; known: {sorted(DEFAULT_POINTS)}")


def with_trigger(kernel, family: str, *, interpret: bool = False):
    """``kernel`` (a Pallas kernel body of ``family``) that first lets the next kernel launch, where the
    family's point is ``"start"`` when traced."""
    _check_family(family)
    if interpret or _points[family] != "start":
        return kernel

    @functools.wraps(kernel)
    def triggered(*refs, **kwargs):
        launch_dependents_p.bind()
        return kernel(*refs, **kwargs)

    return triggered


def check_points(points: dict[str, str]) -> None:
    """A specific error for an unknown family or point in ``points`` (family -> point)."""
    for family, point in points.items():
        _check_family(family)
        if point not in POINTS:
            raise ValueError(f"trigger point {point!r} must be one of {POINTS}")


@contextlib.contextmanager
def trigger_points(points: dict[str, str]):
    """Kernels traced inside trigger at ``points`` (family -> point) instead. jax's trace caches are
    cleared on entry and exit, so that the jitted kernel wrappers trace again under the setting (compiled
    executables already held stay)."""
    check_points(points)
    saved = dict(_points)
    _points.update(points)
    jax.clear_caches()
    try:
        yield
    finally:
        _points.clear()
        _points.update(saved)
        jax.clear_caches()


__all__ = ["DEFAULT_POINTS", "POINTS", "check_points", "launch_dependents_p", "trigger_points",
           "with_trigger"]
