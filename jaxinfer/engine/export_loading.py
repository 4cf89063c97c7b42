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

import numpy as np

from jaxinfer.checkpoint_folder import CheckpointFolder
from jaxinfer.engine import memory
from jaxinfer.engine.aot import BucketGrid
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import plan_cache
from jaxinfer.engine.export import ProgramSet, check_grid
from jaxinfer.engine.export_weights import abstract_params, load_params
from jaxinfer.engine.manifest import CHECK_FINITE, Manifest
from jaxinfer.errors import ExportMismatchError
from jaxinfer.loader import LoadedModel, open_checkpoint, resolve_dtype


@dataclasses.dataclass
class OpenExport:
    """A checked export, ready to load: ``config`` is the engine config to serve with."""

    path: str
    config: EngineConfig
    model_config: object
    model_cls: type
    checkpoint: object
    dtype: object
    mesh: object
    programs: ProgramSet

    def load_model(self, *, progress: bool = False) -> LoadedModel:
        """The checkpoint's weights in the export's parameter layout, checked finite by its program."""
        manifest = self.programs.manifest
        check_finite = self.programs.load(CHECK_FINITE, (abstract_params(manifest, self.mesh),))
        params = load_params(manifest, self.checkpoint, self.model_cls, self.model_config, self.mesh, check_finite,
                             progress=progress)
        return LoadedModel(path=self.path, config=self.model_config, model_cls=self.model_cls,
                           model=self.model_cls(self.model_config, self.dtype), params=params, mesh=self.mesh,
                           dtype=self.dtype)


def _mesh_for(manifest: Manifest, mesh):
    from jaxinfer.sharding import make_mesh

    shape, names = list(manifest.mesh["shape"]), list(manifest.mesh["axis_names"])
    if mesh is None:
        return make_mesh(tensor_parallel=shape[1], data_parallel=shape[0])
    if [int(n) for n in mesh.devices.shape] != shape or list(mesh.axis_names) != names:
        raise ExportMismatchError(f"the export's programs are partitioned over a mesh {dict(zip(names, shape))}; "
                                  f"this mesh is {dict(zip(mesh.axis_names, mesh.devices.shape))}")
    return mesh


def _check_fits(manifest: Manifest, config: EngineConfig, model_cls, model_config, dtype) -> None:
    """``ConfigError`` (before any weight is read) when the export's cache and the weights do not fit
    in this device's free memory."""
    available = memory.available_bytes()
    if available is None:
        return
    weights = sum(int(np.prod(p["shape"])) * np.dtype(p["dtype"]).itemsize for p in manifest.params)
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
    mesh = _mesh_for(manifest, mesh)
    _check_fits(manifest, config, model_cls, model_config, served_dtype)
    manifest.check_files(directory)
    return OpenExport(path, config, model_config, model_cls, checkpoint, served_dtype, mesh,
                      ProgramSet(directory, manifest, mesh))
