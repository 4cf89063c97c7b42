"""A ``Mesh`` with named axes ``("data", "model")`` and the rules that place parameters on it.

Tensor parallelism splits attention heads and MLP width over ``"model"``: column-parallel
projections (q/k/v, gate/up) split their output features, row-parallel ones (o, down) their input
features, embeddings and the LM head their vocabulary. Stacked MoE experts are split whole over the
same axis (expert parallelism). A dimension that does not divide evenly stays replicated. One
device is simply a 1x1 mesh.
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

_RULES: tuple[tuple[re.Pattern, P], ...] = tuple(
    (re.compile(pattern), spec)
    for pattern, spec in (
        (r"experts/(gate_proj|up_proj|down_proj)$", P("model", None, None)),
        (r"experts/(gate_proj|up_proj|down_proj)_bias$", P("model", None)),
        (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/weight$", P("model", None)),
        (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/bias$", P("model")),
        (r"(o_proj|down_proj)/weight$", P(None, "model")),
        (r"(embed_tokens|lm_head)/weight$", P("model", None)),
    )
)


def make_mesh(tensor_parallel: int = 1, data_parallel: int = 1, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    need = tensor_parallel * data_parallel
    if need > len(devices):
        raise ValueError(f"a {data_parallel}x{tensor_parallel} mesh needs {need} devices, {len(devices)} available")
    return Mesh(np.array(devices[:need]).reshape(data_parallel, tensor_parallel), ("data", "model"))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def param_sharding(path: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    name = "/".join(path)
    for pattern, spec in _RULES:
        if pattern.search(name):
            fits = all(axis is None or shape[i] % mesh.shape[axis] == 0 for i, axis in enumerate(spec))
            return NamedSharding(mesh, spec if fits else P())
    return replicated(mesh)
