"""Timing and ceilings shared by the GPU scripts: measured copy bandwidth and matmul rate, and a
timer that runs a jitted function many times on the device without host dispatch in the loop."""

from __future__ import annotations

import glob
import contextlib
import json
import os
import platform
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp


def device_time(fn, *args, iters: int = 50, repeats: int = 5, unroll: int = 1) -> float:
    """Median seconds per call of ``fn(*args)``, whose output must have the first argument's shape
    (the first argument may be a tuple of arrays, e.g. caches updated in place, and the output then
    a tuple like it).

    The calls run inside one jitted ``fori_loop`` that feeds each output back in as the next first
    argument: nothing can be hoisted or sliced away, and no host dispatch sits between calls. Each
    trip of the loop itself costs ~13 us on the H200 (``timer_overhead``); ``unroll`` calls per trip
    spread that over several calls, as the layers of a model step are (give it for microsecond ops).
    """

    def loop(first, *rest):
        def body(_, x):
            return jax.tree.map(lambda out, like: out.astype(like.dtype), fn(x, *rest), x)

        return jax.lax.fori_loop(0, iters, body, first, unroll=unroll)

    run = jax.jit(loop)
    jax.block_until_ready(run(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append((time.perf_counter() - start) / iters)
    return statistics.median(times)


def gpu_kernels(trace_dir: str) -> list[tuple[float, float, str]]:
    """(start ns, end ns, "hlo op | kernel") of every kernel on the first GPU's streams in a
    ``jax.profiler.trace`` directory."""
    from jax.profiler import ProfileData

    (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    data = ProfileData.from_file(path)
    plane = data.find_plane_with_name("/device:GPU:0")
    if plane is None:
        raise RuntimeError(f"no GPU plane in the trace; planes: {[p.name for p in data.planes]}")
    kernels = []
    for line in plane.lines:
        if not line.name.startswith("Stream"):
            continue  # "XLA Ops" / "XLA Modules" repeat the stream events under HLO names
        for event in line.events:
            stats = {name: value for name, value in event.stats}
            name = f"{stats.get('hlo_op', '?')} | {event.name[:80]}"
            kernels.append((event.start_ns, event.start_ns + event.duration_ns, name))
    return sorted(kernels)


def busy_ns(kernels) -> float:
    """Nanoseconds in which some kernel of ``kernels`` was running (the union of their intervals)."""
    busy, cursor = 0.0, None
    for start, end, _ in kernels:
        cursor = start if cursor is None else cursor
        if end > cursor:
            busy += end - max(start, cursor)
            cursor = end
    return busy


def _trace_kernels(fn, args, calls: int):
    run = jax.jit(fn)
    jax.block_until_ready(run(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                jax.block_until_ready(run(*args))
        return gpu_kernels(trace_dir)


def kernel_time(fn, *args, calls: int = 20) -> float:
    """Seconds per call of ``fn(*args)`` in which the GPU was running its kernels, from a profiler
    trace of ``calls`` separate calls: the op's own device time, without the launch gaps and loop
    overhead that ``device_time`` includes (which matter at microsecond scale)."""
    return busy_ns(_trace_kernels(fn, args, calls)) * 1e-9 / calls


def donated_kernel_time(fn, state, *args, calls: int = 20) -> float:
    """Seconds per call of ``state = fn(state, *args)`` in which the GPU ran its kernels, with
    ``state`` donated to each call (an in-place update: no copy of the state, as in the engine),
    from a profiler trace of ``calls`` calls."""
    run = jax.jit(fn, donate_argnums=0)
    state = jax.block_until_ready(run(state, *args))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                state = jax.block_until_ready(run(state, *args))
        return busy_ns(gpu_kernels(trace_dir)) * 1e-9 / calls


def kernel_breakdown(fn, *args, calls: int = 20) -> dict[str, float]:
    """Microseconds per call of each kernel ``fn(*args)`` launches (by name), from a profiler trace."""
    totals: dict[str, float] = {}
    for start, end, name in _trace_kernels(fn, args, calls):
        kernel = name.split(" | ", 1)[-1]
        totals[kernel] = totals.get(kernel, 0.0) + (end - start) * 1e-3 / calls
    return totals


def timer_overhead(unroll: int = 1) -> float:
    """Seconds ``device_time`` reports for a one-element add: the loop's own cost per call."""
    return device_time(lambda x: x + 1, jnp.zeros((1,), jnp.float32), iters=50, unroll=unroll)


def copy_bandwidth() -> float:
    """Bytes/s of ``a * 2`` over 4 GiB of float32, reads and writes counted."""
    a = jnp.ones((1024, 1024, 1024), jnp.float32)
    seconds = device_time(lambda x: x * 2, a, iters=10)
    return 2 * a.size * 4 / seconds


def matmul_rate() -> float:
    """FLOP/s of a bf16 8192^3 matmul."""
    a = jax.random.normal(jax.random.PRNGKey(0), (8192, 8192), jnp.bfloat16) * 8192**-0.25  # x @ x keeps its scale
    seconds = device_time(lambda x: x @ x, a, iters=10)
    return 2 * 8192**3 / seconds


KERNEL_FAMILIES = ("attention", "linear", "mla", "moe", "norm", "sparse_mla", "gated_delta", "kda",
                   "lightning")  # op families of jaxinfer.kernels.registry with GPU kernels
_PROCESS_WIDE = contextlib.ExitStack()  # selections kept for the rest of the process


def force_reference(families) -> None:
    """Run these op families' plain-jnp references instead of their GPU kernels from now on, for the
    rest of the process (A/B runs; ``jaxinfer.kernels.registry.force``)."""
    import importlib

    from jaxinfer.kernels import registry

    for family in families:
        importlib.import_module(f"jaxinfer.kernels.{family}")  # registers its ops
    if families:
        _PROCESS_WIDE.enter_context(registry.force({family: "reference" for family in families}))


def environment() -> dict:
    device = jax.devices()[0]
    return {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def load_revision(path: str, revision: str):
    """The module at ``path`` (relative to the repository) as it was at git ``revision``, imported as a
    module of its own, so that both versions of a kernel compile side by side in one run.
    ``revision`` may also be the folder of a tree exported before (``git archive REV | tar -x -C
    DIR``), for machines without the repository's history."""
    import importlib.util
    import subprocess

    if os.path.isdir(revision):
        with open(os.path.join(revision, path)) as f:
            source = f.read()
    else:
        source = subprocess.run(["git", "show", f"{revision}:{path}"], capture_output=True, text=True,
                                check=True).stdout
    name = os.path.splitext(os.path.basename(path))[0] + "_baseline"
    file = os.path.join(tempfile.mkdtemp(), name + ".py")
    with open(file, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_text(name: str, text: str) -> str:
    """Write ``name`` under ``$JAXINFER_BENCH_DIR`` (default: the working directory); returns its path."""
    path = os.path.join(os.environ.get("JAXINFER_BENCH_DIR") or ".", name)
    with open(path, "w") as f:
        f.write(text)
    return path


def write_json(name: str, payload: dict) -> str:
    return write_text(name, json.dumps(payload, indent=2))
