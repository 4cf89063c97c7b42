"""The weights for an export's programs, loaded without tracing the model or compiling anything.

The live path learns the parameters' shapes from an abstract ``init`` of the model (a trace) and
checks them for NaN / Inf with a jitted reduction (a compile). An export records both instead: the
manifest lists every parameter's path, shape, dtype and partition spec, and carries the compiled
finiteness check. So here the checkpoint is matched against the manifest's parameters (the same
``check_checkpoint`` as the live path: missing, unexpected, mis-shaped tensors are a
``CheckpointError``), each tensor is streamed into its sharded device array (only the device's slice
read, cast on the host), and the export's ``check_finite`` program refuses non-finite weights.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import traverse_util
from jax.sharding import NamedSharding

from jaxinfer import weights
from jaxinfer.engine.manifest import spec_from_json
from jaxinfer.weights import check_checkpoint, stream_params


def expected_params(manifest) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
    """{param path: ShapeDtypeStruct} in the manifest's order (the check_finite program's)."""
    return {tuple(p["path"]): jax.ShapeDtypeStruct(tuple(p["shape"]), np.dtype(p["dtype"])) for p in manifest.params}


def abstract_params(manifest, mesh) -> list[jax.ShapeDtypeStruct]:
    """The parameters as the check_finite program takes them: a flat list of sharded structs."""
    return [jax.ShapeDtypeStruct(tuple(p["shape"]), np.dtype(p["dtype"]),
                                 sharding=NamedSharding(mesh, spec_from_json(p["spec"]))) for p in manifest.params]


def load_params(manifest, checkpoint, model_cls, config, mesh, check_finite, *, progress: bool = False):
    """The parameter pytree for ``manifest``'s programs, read from ``checkpoint``; ``check_finite`` is
    the export's compiled finiteness check (one bool per parameter, in the manifest's order)."""
    expected = expected_params(manifest)
    sources = check_checkpoint(checkpoint, model_cls, config, expected)
    shardings = {path: placed.sharding for path, placed in zip(expected, abstract_params(manifest, mesh))}
    flat = stream_params(checkpoint, sources, expected, shardings, progress=progress)
    weights.check_finite(flat, sources, check_finite)
    return traverse_util.unflatten_dict(flat)
