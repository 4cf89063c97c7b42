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

from jaxinfer.engine.manifest import spec_from_json
from jaxinfer.errors import CheckpointError
from jaxinfer.weights import check_checkpoint


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
    items = list(zip(expected.items(), abstract_params(manifest, mesh)))
    if progress:
        from tqdm.auto import tqdm

        items = tqdm(items, desc="loading weights", unit="tensor")
    flat = {}
    for (path, struct), placed in items:
        source = sources[path]
        flat[path] = jax.make_array_from_callback(
            struct.shape, placed.sharding,
            lambda index, source=source, dtype=struct.dtype: np.asarray(source.read(checkpoint, index)).astype(dtype),
        )
    finite = jax.device_get(check_finite(list(flat.values())))
    bad = [", ".join(sources[path].names) + f" ({flat[path].dtype})" for path, ok in zip(flat, finite) if not ok]
    if bad:
        shown = ", ".join(sorted(bad)[:12]) + (f" ... and {len(bad) - 12} more" if len(bad) > 12 else "")
        raise CheckpointError(f"tensors hold NaN or Inf values (as loaded): {shown}")
    return traverse_util.unflatten_dict(flat)
