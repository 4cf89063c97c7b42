"""Which implementation serves an op call: implementations registered with ``supports`` predicates,
resolved against an explicit target.

Each op (``"attention.ragged_paged_attention"``, ``"moe.route"``, ...) has the plain-jnp reference,
which takes every call, and kernels in order of preference. A kernel serves a call when its
``supports(target, *args, **options)`` holds (can it take these shapes, dtypes and options here: a
complete check, residency included) and its ``preferred(...)`` holds (where it measured faster; a
measured threshold is data with a comment naming the run). Otherwise the next one is tried, and
the reference last. Resolution happens while a program is traced, so a compiled program's choices
are fixed; ``recording()`` collects them (the engine keeps them with each executable).

The target (``Target``: platform, device kind, compute capability, SM count, mesh size, interpret
mode) is explicit: the engine sets its own for its programs (``targeting``); elsewhere it is the
first local device, alone. ``force`` makes tests and A/B scripts take one implementation (skipping
``preferred``, never ``supports``: a forced implementation that cannot take a call raises
``KernelNotSupportedError``); ``variant`` serves an op with a function of the caller's, for A/B
runs of tuning options.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Callable, Iterator, Mapping

import jax

from jaxinfer.errors import KernelNotSupportedError

DEFAULT_SM_COUNT = 132  # an H100's or H200's SMs: tiling for a GPU that does not say (interpret mode, lowering on a CPU)


@dataclasses.dataclass(frozen=True)
class Target:
    """What kernels are chosen for. ``interpret``: Pallas kernels run in interpret mode on the CPU
    (their tests), so every Pallas kernel with an interpreter counts as available."""

    platform: str
    device_kind: str = ""
    compute_capability: str = ""  # "9.0" on Hopper; "" off NVIDIA GPUs
    sm_count: int = 0
    mesh_size: int = 1  # devices one program is partitioned over
    interpret: bool = False

    @property
    def gpu(self) -> bool:
        return self.platform in ("gpu", "cuda") and not self.interpret

    @property
    def sms(self) -> int:
        """The GPU's SMs, which kernels size their grids by; an H200's where the device does not say."""
        return self.sm_count if self.platform in ("gpu", "cuda") and self.sm_count else DEFAULT_SM_COUNT

    @property
    def runs_pallas(self) -> bool:
        """Whether Pallas (Triton lowering) kernels run here: on a GPU, or interpreted."""
        return self.gpu or self.interpret

    @property
    def hopper(self) -> bool:
        """A Hopper GPU (sm_90), which the Mosaic GPU kernels (wgmma, TMA) need; they have no interpreter."""
        return self.gpu and self.compute_capability.startswith("9.")

    @property
    def reads_float8(self) -> bool:
        """Whether Pallas kernels can read float8 e4m3 here: interpreted, or on a GPU of compute
        capability 8.9 and up (Ada, Hopper), from which Triton converts e4m3."""
        if self.interpret:
            return True
        capability = tuple(int(p) for p in self.compute_capability.split(".") if p.isdigit())
        return self.gpu and capability >= (8, 9)

    @classmethod
    def of_device(cls, device=None, *, mesh_size: int = 1) -> "Target":
        device = device if device is not None else jax.devices()[0]
        return cls(platform=device.platform, device_kind=getattr(device, "device_kind", ""),
                   compute_capability=str(getattr(device, "compute_capability", "") or ""),
                   sm_count=int(getattr(device, "core_count", 0) or 0), mesh_size=mesh_size)

    @classmethod
    def of_mesh(cls, mesh: jax.sharding.Mesh) -> "Target":
        return cls.of_device(mesh.devices.flat[0], mesh_size=mesh.devices.size)

    @classmethod
    def interpreted(cls) -> "Target":
        """The Pallas kernels in interpret mode on the CPU (tests of their semantics)."""
        return cls(platform="cpu", interpret=True)


@functools.cache
def _local_target() -> Target:
    return Target.of_device()


_target: contextvars.ContextVar[Target | None] = contextvars.ContextVar("kernel_target", default=None)
_forced: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar("forced_kernels", default={})
_variants: contextvars.ContextVar[Mapping[str, "Implementation"]] = contextvars.ContextVar("kernel_variants",
                                                                                           default={})
_recorders: contextvars.ContextVar[tuple[dict, ...]] = contextvars.ContextVar("kernel_recorders", default=())


def current_target() -> Target:
    return _target.get() or _local_target()


def target_sms() -> int:
    """The SMs of the target kernels are being chosen for (``Target.sms``), for kernels that size
    their grids."""
    return current_target().sms


def target_for(mesh: jax.sharding.Mesh) -> Target:
    """The target set by ``targeting`` if any, else ``mesh``'s."""
    return _target.get() or Target.of_mesh(mesh)


@dataclasses.dataclass(frozen=True)
class Selection:
    """What decides the choices: the target, the forced implementations, the variants. A program
    traced under one keeps its choices; ``applied`` re-enters one for a later trace."""

    target: Target
    forced: tuple[tuple[str, str], ...] = ()
    variants: tuple[tuple[str, "Implementation"], ...] = ()


def selection(target: Target | None = None) -> Selection:
    """The selection in force here (with ``target`` instead of the current one, if given)."""
    return Selection(target or current_target(), tuple(sorted(_forced.get().items())),
                     tuple(sorted(_variants.get().items(), key=lambda item: item[0])))


@contextlib.contextmanager
def applied(chosen: Selection) -> Iterator[None]:
    """Resolve the calls traced inside as under ``chosen``."""
    tokens = (_target.set(chosen.target), _forced.set(dict(chosen.forced)), _variants.set(dict(chosen.variants)))
    try:
        yield
    finally:
        for var, token in zip((_target, _forced, _variants), tokens):
            var.reset(token)


@contextlib.contextmanager
def targeting(target: Target) -> Iterator[Target]:
    """Resolve the op calls traced inside for ``target``."""
    token = _target.set(target)
    try:
        yield target
    finally:
        _target.reset(token)


def _always(target: Target, *args, **options) -> bool:
    return True


def _on_pallas(target: Target, *args, **options) -> bool:
    return target.runs_pallas


def where_pallas_runs(check: Callable[..., bool] | None = None) -> Callable[..., bool]:
    """A Pallas (Triton lowering) kernel's ``supports``: Pallas runs on the target and ``check(*args,
    **options)`` (the kernel's shape and option preconditions) holds."""
    def supports(target: Target, *args, **options) -> bool:
        return target.runs_pallas and (check is None or bool(check(*args, **options)))
    return supports


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way to run an op. ``supports(target, *args, **options)``: whether it can take the call;
    ``preferred(...)``: whether it is chosen by default where it can (forcing skips this);
    ``pallas``: it takes ``interpret=target.interpret``."""

    name: str
    fn: Callable
    supports: Callable[..., bool] = _on_pallas
    preferred: Callable[..., bool] = _always
    pallas: bool = True

    def __call__(self, target: Target, *args, **options):
        if self.pallas:
            options = dict(options, interpret=target.interpret)
        return self.fn(*args, **options)


class Op:
    """An op: its reference (the semantic truth, taking every call) and its kernels, best first."""

    def __init__(self, name: str, reference: Callable, kernels: tuple[Implementation, ...] = ()):
        names = [k.name for k in kernels]
        if "reference" in names or len(set(names)) != len(names):
            raise ValueError(f"{name}: implementation names must be unique and not 'reference': {names}")
        self.name = name
        self.family = name.split(".", 1)[0]
        self.reference = Implementation("reference", reference, supports=_always, pallas=False)
        self.kernels = tuple(kernels)
        _REGISTRY[name] = self

    @property
    def implementations(self) -> dict[str, Implementation]:
        return {k.name: k for k in (*self.kernels, self.reference)}

    def _forced_name(self) -> str | None:
        forced = _forced.get()
        name = forced.get(self.name)
        if name is None and forced.get(self.family) in self.implementations:
            name = forced[self.family]
        return name

    def choose(self, target: Target, *args, **options) -> Implementation:
        """The implementation that serves this call on ``target``."""
        variant = _variants.get().get(self.name)
        if variant is not None:
            return variant
        forced = self._forced_name()
        if forced is not None:
            chosen = self.implementations[forced]
            if not chosen.supports(target, *args, **options):
                raise KernelNotSupportedError(
                    f"{self.name}: the forced implementation {forced!r} does not take this call on {target} "
                    f"(arguments {_describe(args)}, options {sorted(options)})")
            return chosen
        for kernel in self.kernels:
            if kernel.supports(target, *args, **options) and kernel.preferred(target, *args, **options):
                return kernel
        return self.reference

    def __call__(self, *args, **options):
        target = current_target()
        chosen = self.choose(target, *args, **options)
        for recorder in _recorders.get():
            recorder.setdefault(self.name, set()).add(chosen.name)
        return chosen(target, *args, **options)


_REGISTRY: dict[str, Op] = {}


def registered_ops() -> dict[str, Op]:
    """Every op by name (those of the imported op families)."""
    return dict(_REGISTRY)


def unregister(name: str) -> None:
    """Remove an op registered for a test or an experiment."""
    del _REGISTRY[name]


def _describe(args) -> str:
    def one(a):
        return f"{a.dtype}{list(a.shape)}" if hasattr(a, "shape") and hasattr(a, "dtype") else type(a).__name__
    return ", ".join(one(a) for a in jax.tree.leaves(args, is_leaf=lambda a: a is None) if a is not None)


def _check_force_key(key: str, implementation: str) -> None:
    if key in _REGISTRY:
        if implementation not in _REGISTRY[key].implementations:
            raise ValueError(f"{key} has no implementation {implementation!r}; it has "
                             f"{sorted(_REGISTRY[key].implementations)}")
        return
    family = [op for op in _REGISTRY.values() if op.family == key]
    if not family:
        raise ValueError(f"no op or op family {key!r}; ops: {sorted(_REGISTRY)}")
    if not any(implementation in op.implementations for op in family):
        raise ValueError(f"no op of {key!r} has an implementation {implementation!r}")


@contextlib.contextmanager
def force(choices: str | Mapping[str, str], implementation: str | None = None) -> Iterator[None]:
    """Serve ops with one implementation inside the block: ``force("moe", "reference")`` (an op
    family: each of its ops that has that implementation), ``force("moe.route", "router")`` (one op),
    or a mapping of either to implementation names."""
    if isinstance(choices, str):
        if implementation is None:
            raise ValueError("force(name, implementation): give the implementation")
        choices = {choices: implementation}
    for key, name in choices.items():
        _check_force_key(key, name)
    token = _forced.set({**_forced.get(), **choices})
    try:
        yield
    finally:
        _forced.reset(token)


@contextlib.contextmanager
def variant(op: str, fn: Callable, *, pallas: bool = True) -> Iterator[None]:
    """Serve ``op`` with ``fn`` (same signature as the op; ``pallas``: it takes ``interpret``) inside
    the block, for every call: an A/B run of a kernel's tuning options or of another kernel."""
    if op not in _REGISTRY:
        raise ValueError(f"no op {op!r}; ops: {sorted(_REGISTRY)}")
    token = _variants.set({**_variants.get(), op: Implementation("variant", fn, supports=_always, pallas=pallas)})
    try:
        yield
    finally:
        _variants.reset(token)


@contextlib.contextmanager
def recording() -> Iterator[dict[str, set[str]]]:
    """Collect, op name -> implementation names, the choices made by the calls traced inside."""
    chosen: dict[str, set[str]] = {}
    token = _recorders.set((*_recorders.get(), chosen))
    try:
        yield chosen
    finally:
        _recorders.reset(token)


def implementation_names(ops: Any = None) -> dict[str, list[str]]:
    """Registered implementation names per op (for ``jaxinfer info`` and error messages)."""
    return {name: sorted(op.implementations) for name, op in sorted(_REGISTRY.items())
            if ops is None or name in ops}
