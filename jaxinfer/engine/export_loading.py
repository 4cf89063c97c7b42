"""Opening an export for ``LLM(path, executables=DIR)``: every check first, then the weights.

In order, each refusing with an ``ExportError`` / ``ExportMismatchError`` that names the mismatch:
the manifest (present, well-formed); the jax / jaxlib versions and devices; ``config.json``'s
fingerprint; the engine options given against the export's; the checkpoint's config and weight
headers (the same checks as the live path, then the headers' fingerprint); the bucket grid; the
mesh; that the cache fits in memory next to the weights; every program file's size and sha256.
Only then are the weights read (``export_weights``) and the programs loaded (``export.ProgramSet``).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

from jaxinfer.checkpoint_folder import CheckpointFolder
from jaxinfer.checks import is_integer
from jaxinfer.engine import memory
from jaxinfer.engine.aot import BucketGrid
from jaxinfer.cache.checkpoint_scales import read_kv_scales
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import plan_cache
from jaxinfer.engine.export import ProgramSet, check_grid
from jaxinfer.engine.export_weights import abstract_params, load_params
from jaxinfer.engine.manifest import CHECK_FINITE, Manifest
from jaxinfer.errors import ConfigError, ExportError, ExportMismatchError
from jaxinfer.loader import LoadedModel, open_checkpoint, resolve_dtype
from jaxinfer.sharding.plan import LOGICAL_AXES, MESH_AXES, ShardingPlan, as_plan_mesh


@dataclasses.dataclass
class OpenExport:
    """A checked export, ready to load: ``config`` is the engine config to serve with."""

    path: str
    config: EngineConfig
    model_config: object
    model_cls: type
    checkpoint: object
    dtype: object
    plan: ShardingPlan
    programs: ProgramSet

    def load_model(self, *, quantization: str | None = "auto", progress: bool = False) -> LoadedModel:
        """The checkpoint's weights in the export's parameter layout, checked finite by its program
        (``quantization``: as ``load_model``'s; the export's programs must take what it keeps)."""
        manifest = self.programs.manifest
        mesh = self.plan.mesh
        param_axes = {tuple(p["path"]): _logical_axes(p) for p in manifest.params}  # checked before any read
        check_finite = self.programs.load(CHECK_FINITE, (abstract_params(manifest, mesh),))
        params = load_params(manifest, self.checkpoint, self.model_cls, self.model_config, self.plan, param_axes,
                             check_finite, quantization=quantization, progress=progress)
        return LoadedModel(path=self.path, config=self.model_config, model_cls=self.model_cls,
                           model=self.model_cls(self.model_config, self.dtype), params=params, plan=self.plan,
                           dtype=self.dtype, param_axes=param_axes,
                           kv_scales=read_kv_scales(self.checkpoint, self.model_cls.cache_specs(self.model_config)))


def _logical_axes(entry: dict) -> tuple:
    """A manifest parameter entry's logical axes, checked (the manifest is data)."""
    axes = entry.get("axes")
    if (not isinstance(axes, list) or len(axes) != len(entry["shape"])
            or not all(a is None or a in LOGICAL_AXES for a in axes)):
        raise ExportError(f"the manifest's parameter {entry['path']!r} has malformed logical axes {axes!r}: "
                          "export again")
    return tuple(axes)


def _plan_for(manifest: Manifest, mesh) -> ShardingPlan:
    """The export's partitioning on this machine's devices (or on ``mesh``, which must be the same)."""
    shape, names, described = manifest.mesh.get("shape"), manifest.mesh.get("axis_names"), manifest.mesh.get("plan")
    if (names != list(MESH_AXES) or not isinstance(shape, list) or len(shape) != len(MESH_AXES)
            or not all(is_integer(n) and n >= 1 for n in shape) or not isinstance(described, dict)
            or described.get("kv_replicas") != shape[-1]):
        raise ExportError(f"the manifest's mesh {manifest.mesh!r} is malformed: export again")
    replicas = shape[-1]
    if mesh is None:
        devices = jax.devices()
        if len(devices) < int(np.prod(shape)):
            raise ExportMismatchError(f"the export's programs are partitioned over {int(np.prod(shape))} devices "
                                      f"{dict(zip(names, shape))}; this machine has {len(devices)}")
        mesh = Mesh(np.array(devices[:int(np.prod(shape))]).reshape(shape), tuple(names))
    else:
        try:
            mesh = as_plan_mesh(mesh, replicas)
        except ConfigError as e:
            raise ExportMismatchError(f"the export's programs are partitioned over a mesh {dict(zip(names, shape))}; "
                                      f"this mesh cannot hold them: {e}") from None
        if [int(n) for n in mesh.devices.shape] != shape or list(mesh.axis_names) != names:
            raise ExportMismatchError(f"the export's programs are partitioned over a mesh {dict(zip(names, shape))}; "
                                      f"this mesh is {dict(zip(mesh.axis_names, mesh.devices.shape))}")
    return ShardingPlan(mesh, bool(described.get("expert_parallel", False)),
                        frozenset(described.get("replicated", ())))


def _check_fits(manifest: Manifest, config: EngineConfig, model_cls, model_config, dtype) -> None:
    """``ConfigError`` (before any weight is read) when the export's cache and the weights do not fit
    in this device's free memory."""
    available = memory.available_bytes()
    if available is None:
        return
    weights = sum(int(np.prod(part["shape"])) * np.dtype(part["dtype"]).itemsize
                  for p in manifest.params for part in (p["quantized"]["parts"] if "quantized" in p else [p]))
    plan_cache(config, model_cls.cache_specs(model_config), dtype, available - weights)


def open_export(directory: str, path: str, dtype, given: dict, config: EngineConfig, mesh) -> OpenExport:
    """Check the export in ``directory`` against the checkpoint at ``path``, the options ``given``
    explicitly (``config`` holds them, validated) and this machine; see the module docstring."""
    manifest = Manifest.read(directory)
    manifest.check_environment()
    folder = CheckpointFolder(path)
    manifest.check_checkpoint(folder)
    config = dataclasses.replace(config, **manifest.engine_options(given, dtype))
    model_config, model_cls, checkpoint = open_checkpoint(folder.path)
    manifest.check_checkpoint(folder, checkpoint, model_config.architecture)
    config = config.for_model(model_config)
    check_grid(manifest, BucketGrid.from_config(config), config)
    served_dtype = resolve_dtype(manifest.dtype, model_config)
    plan = _plan_for(manifest, mesh)
    _check_fits(manifest, config, model_cls, model_config, served_dtype)
    manifest.check_files(directory)
    return OpenExport(path, config, model_config, model_cls, checkpoint, served_dtype, plan,
                      ProgramSet(directory, manifest, plan.mesh))
