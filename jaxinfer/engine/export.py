"""Export and load an engine's compiled programs, so that serving starts without tracing or compiling.

An export directory holds ``manifest.json`` (``jaxinfer.engine.manifest``) and one file per program
under ``programs/``: every key of the bucket grid, the cache allocation (``allocate_caches``) and the
finiteness check of the loaded weights (``check_finite``), so that nothing between process start and
the first token is compiled. A program is written in one of two forms:

* ``executable``: the compiled executable as data (``jaxinfer.engine.executable_file``: XLA's
  serialized executable and a JSON description of how jax calls it; no pickle). It loads with no
  tracing and no compilation, on the jax, jaxlib and device kind it was built with only.
* ``stablehlo`` (``portable=True``): the program's StableHLO (``jax.export``), which any later jax on
  the same platform can compile (loading compiles, through the persistent compilation cache, but
  never traces model code). Only a program whose every custom call is export-stable can take it; a
  program with a Pallas-Triton kernel cannot, and stays an executable (the manifest says why).

An export directory is data, like a checkpoint folder: nothing in it is unpickled or imported, so
reading it runs no Python code from it. Every read is confined to the directory after symlinks are
resolved (``ExportFolder``); only the files the manifest lists are read, each checked against the
size and sha256 the manifest records (which catches corruption and truncation, not a forger, who
can rewrite the manifest too). The programs themselves are compiled code for the device that XLA
runs as it runs any program it compiled: serve executables from a source you trust with your
devices, or a portable export, which this machine compiles itself.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import importlib.util
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp

from jaxinfer.engine import executable_file
from jaxinfer.engine.aot import CompileKey
from jaxinfer.engine.manifest import (ALLOCATE, CHECK_FINITE, EXECUTABLE, MANIFEST_FILE, PROGRAM_OPTIONS, STABLEHLO,
                                      ExportFolder, Manifest, ProgramEntry, config_fingerprint, environment,
                                      spec_to_json, weights_fingerprint)
from jaxinfer.errors import ExportError, ExportMismatchError
from jaxinfer import weights
from jaxinfer.kernels import registry as kernel_registry
from jaxinfer.quantization import QUANTIZED_WEIGHTS

__all__ = ["ProgramSet", "write_export"]

PROGRAMS_DIR = "programs"


def _file_name(name: str, key: CompileKey | None, form: str) -> str:
    stem = name if key is None else f"{key.kind}-t{key.num_tokens}-s{key.num_seqs}-p{key.pages_per_seq}"
    return f"{PROGRAMS_DIR}/{stem}.{'bin' if form == EXECUTABLE else 'stablehlo'}"


def _flat_inputs(program, inputs_tree):
    """``program(params, caches, *inputs)`` as a function of the inputs' leaves: jax.export serializes
    only standard containers, and the step inputs are dataclass pytrees."""
    def flat(params, caches, *leaves):
        return program(params, caches, *jax.tree.unflatten(inputs_tree, leaves))

    return flat


def _serialize_stablehlo(jitted, args) -> tuple[bytes | None, str | None]:
    """-> (serialized ``jax.export.Exported``, None), or (None, why not) for a program with a custom
    call that has no compatibility guarantee (a Pallas-Triton kernel)."""
    try:
        exported = jax.export.export(jitted)(*args)
    except ValueError as e:
        if "custom call" not in str(e).lower():
            raise
        return None, " ".join(str(e).split())[:300]
    return bytes(exported.serialize()), None


def _layout_json(layout, plan) -> dict:
    layers = [{name: {"shape": list(s.shape), "dtype": s.dtype.name, "spec": spec_to_json(s.sharding.spec)}
               for name, s in sorted(layer.items())} for layer in layout.abstract(plan)]
    return {"page_size": layout.page_size, "num_pages": layout.num_pages, "num_slots": layout.num_slots,
            "layers": layers}


def _param_json(path: tuple, value, axes: tuple, dtype) -> dict:
    """A parameter's manifest entry. A quantized weight (``jaxinfer.quantization``) records the shape
    and serving dtype of the weight it stands for, and its parts (``quantized``: their pytree
    structure, each part's shape, dtype and spec), which the export's programs take."""
    if not isinstance(value, QUANTIZED_WEIGHTS):
        return {"path": list(path), "shape": list(value.shape), "dtype": value.dtype.name,
                "spec": spec_to_json(value.sharding.spec), "axes": list(axes)}
    parts = jax.tree.leaves(value)
    return {"path": list(path), "shape": list(value.shape), "dtype": jnp.dtype(dtype).name,
            "spec": spec_to_json(parts[0].sharding.spec), "axes": list(axes),
            "quantized": {"tree": executable_file.tree_to_json(jax.tree.structure(value)),
                          "parts": [{"shape": list(p.shape), "dtype": p.dtype.name,
                                     "spec": spec_to_json(p.sharding.spec)} for p in parts]}}


def _params_json(abstract_params, param_axes: dict, dtype) -> tuple[list[dict], list]:
    """The parameters in a fixed order (sorted paths): their manifest entries (with their logical
    axes) and the abstract values."""
    from flax import traverse_util

    flat = sorted(traverse_util.flatten_dict(abstract_params).items())
    return [_param_json(path, s, param_axes[path], dtype) for path, s in flat], [s for _, s in flat]


@contextlib.contextmanager
def _fresh_compiles():
    """Compile without the persistent compilation cache: an executable read from it cannot be
    serialized again (jax 0.10.2 on CPU: the copy loses its functions, "Function ... not found").
    JAX decides once whether it uses the cache; resetting it makes the next compile ask again; and
    it keeps the executables it compiled in memory, which ``jax.clear_caches()`` drops."""
    from jax.experimental.compilation_cache import compilation_cache

    was = jax.config.jax_enable_compilation_cache
    jax.clear_caches()
    compilation_cache.reset_cache()
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()


def _compile_all(runner, lowered: dict, progress: bool) -> dict:
    """{name: Compiled} for {name: Lowered}, compiled in parallel threads (as the warm-up does).
    Compiler options are always passed (even none): a ``Lowered`` keeps the executable it compiled
    without options, which may be one the persistent cache gave."""
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(lowered), desc="compiling for the export", unit="program")

    def compile_one(program):
        compiled = program.compile(compiler_options=dict(runner.compiler_options))
        bar and bar.update()
        return compiled

    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            return dict(zip(lowered, pool.map(compile_one, lowered.values())))
    finally:
        bar and bar.close()


def _manifest(engine, param_entries: list[dict], entries: list[ProgramEntry]) -> Manifest:
    from jaxinfer.checkpoint_folder import CheckpointFolder
    from jaxinfer.loader import open_checkpoint

    runner, model, config, grid, mesh = engine.runner, engine.model, engine.config, engine.grid, engine.model.mesh
    model_config, _, checkpoint = open_checkpoint(model.path)
    return Manifest(
        environment=environment(),
        checkpoint={"path": os.path.abspath(model.path), "architecture": model_config.architecture,
                    "config_sha256": config_fingerprint(CheckpointFolder(model.path)),
                    "weights_header_sha256": weights_fingerprint(checkpoint)},
        dtype=jnp.dtype(model.dtype).name,
        engine={name: getattr(config, name) for name in PROGRAM_OPTIONS},
        mesh={"axis_names": list(mesh.axis_names), "shape": [int(n) for n in mesh.devices.shape],
              "plan": model.plan.describe()},
        kernel_target=dataclasses.asdict(runner.kernel_selection.target),
        grid={"token_buckets": list(grid.token_buckets), "seq_buckets": list(grid.seq_buckets),
              "page_buckets": list(grid.page_buckets), "keys": [str(k) for k in grid.keys(config)]},
        cache=_layout_json(engine.layout, model.plan),
        params=param_entries,
        programs=entries,
    )


def write_export(engine, directory: str, *, portable: bool = False, progress: bool = False) -> Manifest:
    """Write ``engine``'s programs (the whole grid) and the manifest to ``directory`` (replaced if it
    holds an export; refused if it holds anything else). Executables are compiled afresh here;
    ``portable`` writes StableHLO where it can. The directory appears complete or not at all."""
    directory = os.fspath(directory)
    if os.path.exists(directory) and (not os.path.isdir(directory) or (
            os.listdir(directory) and not os.path.isfile(os.path.join(directory, MANIFEST_FILE)))):
        raise ExportError(f"{directory!r} exists and is not an export directory: give a new or empty folder")
    if portable and importlib.util.find_spec("flatbuffers") is None:  # jax.export serializes with it
        raise ExportError("a portable export needs the flatbuffers package (pip install flatbuffers)")
    runner, config = engine.runner, engine.config
    param_entries, flat_params = _params_json(runner.abstract_params(), engine.model.param_axes, engine.model.dtype)
    keys = engine.grid.keys(config)

    # Every program as (name, key, jitted function, abstract arguments); grid programs take their
    # step inputs as leaves (see _flat_inputs).
    programs = []
    for key in keys:
        params, caches, *inputs = runner.abstract_args(key)
        leaves, tree = jax.tree.flatten(inputs)
        programs.append((str(key), key, jax.jit(_flat_inputs(runner.traced_program(key.kind), tree),
                                                donate_argnums=(1,)), (params, caches, *leaves)))
    programs.append((ALLOCATE, None, runner.allocator_program(), ()))
    programs.append((CHECK_FINITE, None, jax.jit(weights.all_finite), (flat_params,)))

    for key in keys:
        if key not in runner.kernel_choices:
            runner.lower(key)  # records the kernels its trace chooses
    stablehlo, not_portable = {}, {}
    with kernel_registry.applied(runner.kernel_selection):
        if portable:
            for name, _, jitted, args in programs:
                stablehlo[name], not_portable[name] = _serialize_stablehlo(jitted, args)
        with _fresh_compiles():
            lowered = {}
            for name, key, jitted, args in programs:
                if stablehlo.get(name) is None:
                    lowered[name] = runner.lower(key) if key is not None else jitted.lower(*args)
            compiled = _compile_all(runner, lowered, progress)
    for name, key, _, _ in programs:  # the engine serves with what it exported
        if key is not None and name in compiled:
            runner.add_executable(key, compiled[name])
    if ALLOCATE in compiled:
        runner.install_allocator(compiled[ALLOCATE])

    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        os.makedirs(os.path.join(staging, PROGRAMS_DIR))
        entries = []
        for name, key, _, _ in programs:
            form = STABLEHLO if stablehlo.get(name) is not None else EXECUTABLE
            data = stablehlo[name] if form == STABLEHLO else executable_file.serialize(compiled[name])
            file = _file_name(name, key, form)
            with open(os.path.join(staging, file), "wb") as f:
                f.write(data)
            entries.append(ProgramEntry(
                name=name, form=form, file=file, size=len(data), sha256=hashlib.sha256(data).hexdigest(), key=key,
                kernels=runner.kernel_choices.get(key, {}) if key is not None else {},
                not_portable=not_portable.get(name)))
        manifest = _manifest(engine, param_entries, entries)
        with open(os.path.join(staging, MANIFEST_FILE), "w", encoding="utf-8") as f:
            f.write(manifest.to_json())
        if os.path.exists(directory):
            shutil.rmtree(directory)
        os.replace(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


class _FlatCall:
    """A program compiled from StableHLO, called as the runner calls its programs:
    ``(params, caches, *inputs)``, the inputs passed on as their leaves."""

    def __init__(self, compiled):
        self.compiled = compiled

    def __call__(self, params, caches, *inputs):
        return self.compiled(params, caches, *jax.tree.leaves(inputs))


def _avals(tree) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of every leaf: arrays, ShapeDtypeStructs, or a compiled program's ``ArgInfo``s."""
    leaves = [getattr(x, "_aval", x) for x in jax.tree.leaves(tree)]
    return [(tuple(x.shape), jnp.dtype(x.dtype).name) for x in leaves]


def _prepare_runtime() -> None:
    """What jax sets up for a program when it lowers one, done here for programs it never lowered:
    on the CPU, jaxlib's table of LAPACK functions (a triangular solve calls through it; a program
    loaded into a process that lowered none would call through an empty entry and crash)."""
    if jax.default_backend() == "cpu":
        from jax._src.lax import linalg

        linalg.initialize_lapack()


class ProgramSet:
    """The programs of an export directory whose manifest has been checked, loaded one by one:
    each file's sha256 is checked again on the bytes that are then deserialized."""

    def __init__(self, directory: str, manifest: Manifest, mesh):
        self.directory = directory
        self.folder = ExportFolder(directory)
        self.manifest = manifest
        self.mesh = mesh
        self.num_loaded = 0
        _prepare_runtime()


    def _read(self, entry: ProgramEntry) -> bytes:
        path = os.path.join(self.directory, entry.file)
        data = self.folder.read_bytes(entry.file, what=f"the program file of {entry.name}")
        if data is None or len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256:
            raise ExportError(f"{path} changed after the export's files were checked: export again")
        return data

    def load(self, name: str, args: tuple):
        """The program ``name``, callable on arguments like ``args`` (abstract, sharded)."""
        entry = self.manifest.program(name)
        data = self._read(entry)
        path = os.path.join(self.directory, entry.file)
        flat_args = args
        if entry.key is not None:
            params, caches, *inputs = args
            flat_args = (params, caches, *jax.tree.leaves(inputs))
        if entry.form == EXECUTABLE:
            try:
                program = executable_file.deserialize(data, list(self.mesh.devices.flat))
            except ExportError as e:
                raise ExportError(f"{path}: {e}; export again") from e
            except Exception as e:  # XLA refused the bytes: another jax build or device
                raise ExportMismatchError(f"{path} does not load here ({type(e).__name__}: {e}); export again") from e
            taken = _avals(program.args_info)
        else:
            try:
                exported = jax.export.deserialize(bytearray(data))
            except Exception as e:
                raise ExportMismatchError(f"{path} is StableHLO this jax cannot read ({type(e).__name__}: {e}); "
                                          "export again") from e
            taken = [(tuple(a.shape), jnp.dtype(a.dtype).name) for a in exported.in_avals]
        if taken != _avals(flat_args if entry.form == STABLEHLO else (args, {})):
            raise ExportError(f"{path} takes other inputs than the manifest describes for {name}: the manifest was "
                              "edited, or the file belongs to another export; export again")
        if entry.form == STABLEHLO:
            donate = (1,) if entry.key is not None else ()
            compiled = jax.jit(exported.call, donate_argnums=donate).lower(*flat_args).compile()
            program = _FlatCall(compiled) if entry.key is not None else compiled
        self.num_loaded += 1
        return program

    def install(self, runner, *, eager: bool = True) -> int:
        """Give ``runner`` the cache allocation and the grid: every grid program now (``eager``), or
        each on its first use (executables only: deserializing one is neither a trace nor a compile,
        while a StableHLO program compiles, so those always load now). -> how many were loaded."""
        before = self.num_loaded
        runner.install_allocator(self.load(ALLOCATE, ()))
        for entry in self.manifest.grid_programs:
            if eager or entry.form == STABLEHLO:
                program = self.load(entry.name, runner.abstract_args(entry.key))
            else:
                program = _OnFirstUse(self, entry.name, runner.abstract_args(entry.key))
            runner.install(entry.key, program, entry.kernels)
        return self.num_loaded - before


class _OnFirstUse:
    """A grid program of an export, deserialized the first time it is called."""

    def __init__(self, programs: ProgramSet, name: str, args: tuple):
        self._programs, self._name, self._args = programs, name, args
        self._program = None

    def __call__(self, *args):
        if self._program is None:
            self._program = self._programs.load(self._name, self._args)
        return self._program(*args)


def check_grid(manifest: Manifest, grid, config) -> None:
    """The export's keys are the grid this engine's options give (``ExportError`` otherwise: a
    manifest edited by hand)."""
    want = sorted(grid.keys(config))
    have = sorted(p.key for p in manifest.grid_programs)
    if want != have:
        missing = [str(k) for k in want if k not in have][:4]
        raise ExportError(f"the export's programs are not the grid of its engine options (missing e.g. {missing}): "
                          "the manifest was edited or the export is incomplete; export again")
