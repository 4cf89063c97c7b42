"""The weights for an export's programs, loaded without tracing the model or compiling anything.

The live path learns the parameters' shapes from an abstract ``init`` of the model (a trace) and
checks them for NaN / Inf with a jitted reduction (a compile). An export records both instead: the
manifest lists every parameter's path, shape, dtype and partition spec, and carries the compiled
finiteness check. So here the checkpoint is matched against the manifest's parameters (the same
``check_checkpoint`` as the live path: missing, unexpected, mis-shaped tensors are a
``CheckpointError``), each tensor is streamed into its sharded device array (only the device's slice
read, cast on the host), and the export's ``check_finite`` program refuses non-finite weights.

A weight the export's programs take quantized (an fp8 or MXFP4 weight, ``jaxinfer.quantization``)
is recorded with its parts; the checkpoint must keep the same weights quantized, in the same parts,
which is decided from its headers before anything is read.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import traverse_util
from jax.sharding import NamedSharding

from jaxinfer import weights
from jaxinfer.engine import executable_file
from jaxinfer.engine.manifest import spec_from_json
from jaxinfer.errors import ExportError, ExportMismatchError
from jaxinfer.weights import check_checkpoint, quantized_streams, stream_all


def expected_params(manifest) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
    """{param path: ShapeDtypeStruct} in the manifest's order (the check_finite program's): the
    weight a quantized parameter stands for, in the serving dtype."""
    return {tuple(p["path"]): jax.ShapeDtypeStruct(tuple(p["shape"]), np.dtype(p["dtype"])) for p in manifest.params}


def _abstract_param(entry: dict, mesh):
    def struct(part):
        return jax.ShapeDtypeStruct(tuple(part["shape"]), np.dtype(part["dtype"]),
                                    sharding=NamedSharding(mesh, spec_from_json(part["spec"])))

    quantized = entry.get("quantized")
    if quantized is None:
        return struct(entry)
    try:
        tree = executable_file.tree_from_json(quantized["tree"])
        if tree.num_leaves != len(quantized["parts"]):
            raise ValueError(f"{tree.num_leaves} parts in its structure, {len(quantized['parts'])} listed")
        return tree.unflatten([struct(part) for part in quantized["parts"]])
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"the manifest's parameter {entry['path']!r} has a malformed quantized record ({e}): "
                          "export again") from None


def abstract_params(manifest, mesh) -> list:
    """The parameters as the check_finite program takes them: a flat list of sharded structs (a
    quantized weight: its parts, in its structure)."""
    return [_abstract_param(p, mesh) for p in manifest.params]


def _describe(value) -> list:
    return [(tuple(leaf.shape), np.dtype(leaf.dtype).name, leaf.sharding) for leaf in jax.tree.leaves(value)]


def load_params(manifest, checkpoint, model_cls, config, plan, param_axes: dict, check_finite, *,
                quantization: str | None = "auto", progress: bool = False):
    """The parameter pytree for ``manifest``'s programs, read from ``checkpoint`` on ``plan``'s mesh;
    ``check_finite`` is the export's compiled finiteness check (one bool per parameter, in the
    manifest's order). ``ExportMismatchError`` before any read when the checkpoint, loaded with
    ``quantization``, keeps other weights quantized than the export's programs take."""
    expected = expected_params(manifest)
    abstract = dict(zip(expected, abstract_params(manifest, plan.mesh)))
    sources = check_checkpoint(checkpoint, model_cls, config, expected)
    kept = quantized_streams(checkpoint, sources, expected, param_axes, plan) if quantization == "auto" else {}
    recorded = {path for path, entry in zip(expected, manifest.params) if "quantized" in entry}
    if set(kept) != recorded:
        differ = sorted("/".join(path) for path in set(kept) ^ recorded)
        raise ExportMismatchError(
            f"the export's programs take {len(recorded)} weights quantized; this checkpoint with "
            f"quantization={quantization!r} keeps {len(kept)} quantized (they differ at {differ[:4]}): give the "
            "quantization the export was made with, or export again")
    shardings = {path: a.sharding for path, a in abstract.items() if path not in kept}
    flat = stream_all(checkpoint, sources, expected, shardings, kept, progress=progress)
    wrong = [path for path in kept if _describe(flat[path]) != _describe(abstract[path])
             or jax.tree.structure(flat[path]) != jax.tree.structure(abstract[path])]
    if wrong:
        raise ExportMismatchError(f"quantized weights load in other parts than the export records: "
                                  f"{['/'.join(p) for p in wrong[:4]]}: export again for this checkpoint")
    weights.check_finite(flat, sources, check_finite)
    return traverse_util.unflatten_dict(flat)
