"""The manifest of an export: what its programs were built for, and the checks that refuse a mismatch.

``manifest.json`` (indented, keys sorted, for people to read) records the engine options that shape
the programs, the bucket grid, the cache layout (every layer's arrays: shape, dtype, partition spec),
the parameters (shape, dtype, partition spec), the mesh, the kernels each program was built with, the
checkpoint it was built from (its path, and sha256 fingerprints of ``config.json`` and of the weight
files' headers: tensor names, shapes and dtypes; weights are not copied), and the jax / jaxlib
versions and devices it was built on. Every program file is listed with its size and sha256.

Everything here is host work on small files: an export made for another checkpoint, config, engine
option, jax version or device is refused (``ExportMismatchError``, naming what differs) before any
weight is read or anything is allocated on a device.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import jax
import jaxlib

from jaxinfer.checkpoint_folder import CheckpointFolder, ConfinedFolder
from jaxinfer.engine.aot import CompileKey
from jaxinfer.errors import ExportError, ExportMismatchError

MANIFEST_FILE = "manifest.json"
FORMAT = "jaxinfer-export"
FORMAT_VERSION = 2

EXECUTABLE = "executable"  # jax.experimental.serialize_executable: this jax, jaxlib and device kind only
STABLEHLO = "stablehlo"  # jax.export: portable across jax versions and device kinds of one platform
FORMS = (EXECUTABLE, STABLEHLO)

ALLOCATE = "allocate_caches"  # the program that makes the zero-filled caches
CHECK_FINITE = "check_finite"  # the program that refuses NaN / Inf weights after loading

# The engine options the programs depend on; an export fixes them. The others (strict, seed, the
# compilation cache, progress bars, ...) are free at load time.
PROGRAM_OPTIONS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "page_size", "num_pages",
                   "decode_steps", "max_logprobs", "max_stop_token_ids", "min_token_bucket", "page_bucket_growth",
                   "tensor_parallel_size", "data_parallel_size", "enable_expert_parallel", "kv_cache_dtype")
# Program options exports record since they were added; an export without one was built with this value.
LATER_OPTIONS = {"kv_cache_dtype": "auto"}


class ExportFolder(ConfinedFolder):
    """An export directory: every file read resolves, after symlinks, inside it."""

    error = ExportError
    kind = "export directory"

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise ExportError(f"{path!r} is not a folder: point at a directory written by `jaxinfer export`")
        super().__init__(path)


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def config_fingerprint(folder: CheckpointFolder) -> str:
    """sha256 of ``config.json``'s bytes."""
    real = folder.resolve("config.json", what="config file")
    if real is None:
        raise ExportError(f"no config.json in {folder.path!r}")
    return sha256_file(real)


def weights_fingerprint(checkpoint) -> str:
    """sha256 over the weight files' headers, as the model reads them: every tensor's name, shape and
    stored dtype (sorted by name; which file holds a tensor does not matter)."""
    header = [[name, list(checkpoint.shape(name)), checkpoint.dtype(name)] for name in checkpoint.names()]
    return hashlib.sha256(json.dumps(header, separators=(",", ":")).encode()).hexdigest()


def environment() -> dict:
    """The software and devices programs are built for."""
    devices = jax.devices()
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "platform": devices[0].platform,
            "device_kind": devices[0].device_kind, "device_count": len(devices)}


def spec_to_json(spec) -> list:
    """A ``PartitionSpec`` as a list: an axis name, a list of names, or null per dimension."""
    return [list(a) if isinstance(a, tuple) else a for a in spec]


def spec_from_json(entries) -> "jax.sharding.PartitionSpec":
    from jax.sharding import PartitionSpec

    return PartitionSpec(*(tuple(a) if isinstance(a, list) else a for a in entries))


@dataclasses.dataclass
class ProgramEntry:
    """One program file: a grid key's program, or ``ALLOCATE`` / ``CHECK_FINITE``."""

    name: str
    form: str  # EXECUTABLE or STABLEHLO
    file: str  # relative to the export directory
    size: int
    sha256: str
    key: CompileKey | None = None
    kernels: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # op -> implementations
    not_portable: str | None = None  # why a portable export kept this program an executable

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["key"] = None if self.key is None else dataclasses.asdict(self.key)
        return out

    @classmethod
    def from_json(cls, raw: dict) -> "ProgramEntry":
        key = raw.get("key")
        return cls(name=raw["name"], form=raw["form"], file=raw["file"], size=int(raw["size"]), sha256=raw["sha256"],
                   key=None if key is None else CompileKey(**key), kernels=dict(raw.get("kernels") or {}),
                   not_portable=raw.get("not_portable"))


@dataclasses.dataclass
class Manifest:
    environment: dict  # environment()
    checkpoint: dict  # path, architecture, config_sha256, weights_header_sha256
    dtype: str  # the serving dtype
    engine: dict  # PROGRAM_OPTIONS -> value
    mesh: dict  # axis_names, shape, plan (jaxinfer.sharding.ShardingPlan.describe())
    kernel_target: dict  # what the kernels were chosen for (jaxinfer.kernels.registry.Target)
    grid: dict  # token_buckets, seq_buckets, page_buckets
    cache: dict  # page_size, num_pages, num_slots, layers: [{array: {shape, dtype, spec}}]
    # {path: [...], shape, dtype, spec, axes[, quantized: {tree, parts: [{shape, dtype, spec}]}]}, in the order
    # the check_finite program takes them
    params: list[dict]
    programs: list[ProgramEntry]

    def to_json(self) -> str:
        body = {"format": FORMAT, "format_version": FORMAT_VERSION,
                **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "programs"},
                "programs": [p.to_json() for p in self.programs]}
        return _dumps(body) + "\n"

    @classmethod
    def read(cls, directory: str) -> "Manifest":
        """The manifest of an export directory; ``ExportError`` when it is missing or malformed."""
        path = os.path.join(directory, MANIFEST_FILE)
        data = ExportFolder(directory).read_bytes(MANIFEST_FILE, what="the manifest")
        if data is None:
            raise ExportError(f"{directory!r} holds no {MANIFEST_FILE}: it is not an export (write one with "
                              "`jaxinfer export` or LLM.export)")
        try:
            raw = json.loads(data.decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise ExportError(f"{path} is not valid JSON (truncated or edited?): {e}") from e
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ExportError(f"{path} is not a jaxinfer export manifest (no \"format\": \"{FORMAT}\")")
        if raw.get("format_version") != FORMAT_VERSION:
            raise ExportMismatchError(f"{path} has format version {raw.get('format_version')!r}; this jaxinfer reads "
                                      f"version {FORMAT_VERSION}: export again")
        try:
            manifest = cls(**{f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name != "programs"},
                           programs=[ProgramEntry.from_json(p) for p in raw["programs"]])
            manifest._check_shape()
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            missing = f"missing {e}" if isinstance(e, KeyError) else str(e)
            raise ExportError(f"{path} is malformed ({missing}): export again") from e
        return manifest

    def _check_shape(self) -> None:
        for name, kind in (("environment", dict), ("checkpoint", dict), ("engine", dict), ("mesh", dict),
                           ("grid", dict), ("cache", dict), ("params", list), ("kernel_target", dict)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name!r} must be a {kind.__name__}")
        for p in self.params:
            if isinstance(p, dict) and "quantized" in p and not _is_quantized_record(p["quantized"]):
                raise ValueError(f"parameter {p.get('path')!r} has a malformed quantized record")
        names = set()
        for p in self.programs:
            if p.form not in FORMS:
                raise ValueError(f"program {p.name!r} has form {p.form!r}, not one of {FORMS}")
            if not isinstance(p.file, str) or os.path.isabs(p.file) or ".." in p.file.replace("\\", "/").split("/"):
                raise ValueError(f"program {p.name!r} names the file {p.file!r}, which is not inside the export")
            if p.name in names:
                raise ValueError(f"program {p.name!r} is listed twice")
            names.add(p.name)
        for name in (ALLOCATE, CHECK_FINITE):
            if name not in names:
                raise ValueError(f"no {name!r} program")

    # ---- what the programs are ---------------------------------------------------------------

    @property
    def grid_programs(self) -> list[ProgramEntry]:
        return [p for p in self.programs if p.key is not None]

    def program(self, name: str) -> ProgramEntry:
        return next(p for p in self.programs if p.name == name)

    @property
    def forms(self) -> set[str]:
        return {p.form for p in self.programs}

    # ---- checks, in the order they run (all before anything is allocated) ---------------------

    def check_environment(self, here: dict | None = None) -> None:
        """Executables load only on the jax, jaxlib and device kind they were built with; StableHLO on
        the same platform, any jax that reads it. Both need the device count (the mesh)."""
        here = here or environment()
        built = self.environment
        fields = ["platform", "device_count"]
        if EXECUTABLE in self.forms:
            fields += ["jax", "jaxlib", "device_kind"]
        wrong = [f"{f} {built.get(f)!r} (here: {here[f]!r})" for f in fields if built.get(f) != here[f]]
        if wrong:
            raise ExportMismatchError(
                "the export was built for " + ", ".join(wrong) + "; serialized executables run only where they "
                "were built: export again here" + (" (or export with --portable, whose StableHLO programs load "
                                                    "on any device kind and jax version of the platform)"
                                                    if EXECUTABLE in self.forms else "")
            )

    def check_checkpoint(self, folder: CheckpointFolder, checkpoint=None, architecture: str | None = None) -> None:
        """``config.json`` (and, given ``checkpoint``, the weight headers and the architecture) against
        the fingerprints recorded at export."""
        recorded = self.checkpoint
        built_from = f"the export was built from {recorded.get('path')!r}"
        if config_fingerprint(folder) != recorded.get("config_sha256"):
            raise ExportMismatchError(
                f"config.json of {folder.path!r} differs from the one {built_from} (sha256 "
                f"{config_fingerprint(folder)[:16]}... against {str(recorded.get('config_sha256'))[:16]}...): the "
                "config was edited or this is another model; export again for this checkpoint"
            )
        if architecture is not None and architecture != recorded.get("architecture"):
            raise ExportMismatchError(f"{folder.path!r} is a {architecture}; {built_from}, a "
                                      f"{recorded.get('architecture')}")
        if checkpoint is not None and weights_fingerprint(checkpoint) != recorded.get("weights_header_sha256"):
            raise ExportMismatchError(
                f"the weight files of {folder.path!r} do not hold the tensors (names, shapes, dtypes) {built_from}: "
                "this is another checkpoint; export again for it"
            )

    def engine_options(self, given: dict, dtype: str | None) -> dict:
        """The program options to serve with: the export's. ``given`` (the options the caller set
        explicitly) must agree with them; ``dtype`` ("auto"/None: the export's) too."""
        given = {name: value for name, value in given.items()  # None: "the default" for these two
                 if name in PROGRAM_OPTIONS and not (value is None and name in ("max_model_len", "num_pages"))}
        wrong = [f"{name}={value!r} (the export has {self._option(name)!r})" for name, value in sorted(given.items())
                 if value != self._option(name)]
        if dtype not in (None, "auto") and _dtype_name(dtype) != self.dtype:
            wrong.append(f"dtype={_dtype_name(dtype)!r} (the export has {self.dtype!r})")
        if wrong:
            raise ExportMismatchError(
                "the export's programs were built for other engine options: " + "; ".join(wrong) +
                ". Leave these options out to serve with the export's, or export again with them"
            )
        return {name: self._option(name) for name in PROGRAM_OPTIONS}

    def _option(self, name: str):
        """The export's value of program option ``name`` (``LATER_OPTIONS``' where it records none)."""
        if name not in self.engine and name in LATER_OPTIONS:
            return LATER_OPTIONS[name]
        return self.engine[name]

    def check_files(self, directory: str) -> None:
        """Every program file is present inside the directory with the size and sha256 the manifest
        records."""
        folder = ExportFolder(directory)
        for p in self.programs:
            path = os.path.join(directory, p.file)
            real = folder.resolve(p.file, what=f"the program file of {p.name}")
            if real is None:
                raise ExportError(f"{path} is missing (the manifest lists it for {p.name}): the export is incomplete")
            size = os.path.getsize(real)
            if size != p.size:
                raise ExportError(f"{path} has {size} bytes; the manifest records {p.size} for {p.name}: the file "
                                  "is truncated or was replaced, or the manifest was edited: export again")
            if sha256_file(real) != p.sha256:
                raise ExportError(f"{path} does not match the sha256 the manifest records for {p.name}: the file is "
                                  "corrupt or was replaced, or the manifest was edited: export again")


def _is_quantized_record(raw) -> bool:
    """A quantized parameter's record: its pytree structure and a {shape, dtype, spec} per part."""
    parts = raw.get("parts") if isinstance(raw, dict) else None
    return (isinstance(parts, list) and "tree" in raw
            and all(isinstance(part, dict) and {"shape", "dtype", "spec"} <= set(part) for part in parts))


def _dumps(value, indent: int = 0) -> str:
    """JSON with sorted keys, indented, but a list of plain values (a shape, a spec) on one line."""
    pad, inner = " " * indent, " " * (indent + 2)
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(str(k))}: {_dumps(v, indent + 2)}" for k, v in sorted(value.items())]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, list) and any(isinstance(v, (dict, list)) and v for v in value):
        return "[\n" + ",\n".join(inner + _dumps(v, indent + 2) for v in value) + f"\n{pad}]"
    return json.dumps(value)


def _dtype_name(dtype) -> str:
    import numpy as np

    return dtype if isinstance(dtype, str) else np.dtype(dtype).name
