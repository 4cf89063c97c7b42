"""A compiled program as a file of data: XLA's serialized executable and a JSON description of its calls.

``jax.experimental.serialize_executable`` pickles the executable together with the Python objects
jax calls it through (avals, shardings, layouts, pytree structures), and unpickling can run any
code. This module writes the same content without pickle: the executable's bytes as XLA serializes
them, and beside them every field jax needs to call it, as plain JSON. Loading rebuilds those
objects from a fixed set of types (``ShapedArray``, the three kinds of sharding, ``Layout``, the
pytree nodes of ``TREE_NODES``) and hands the bytes to XLA's own deserializer: nothing in the file
names a Python callable, so nothing in it can make Python run code.

A file is ``MAGIC``, the header's length (8 bytes, little-endian), the header (UTF-8 JSON), then
the executable. ``describe`` checks, when the program is written, that the description rebuilds
every field exactly; a program it cannot describe (effects, host callbacks, closed-over state) is
refused then, never written in a form that would load differently.
"""

from __future__ import annotations

import dataclasses
import json
import struct

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
from jax.tree_util import PyTreeDef, default_registry

from jaxinfer.errors import ExportError

MAGIC = b"jaxinfer-xla-executable\n"
_LENGTH = struct.Struct("<Q")
MAX_HEADER_BYTES = 1 << 28  # a header describes arrays, not data: far below this


def _tree_nodes() -> dict[str, type]:
    """The pytree node types a program's arguments and results may be built of: the standard
    containers, the engine's own step inputs (see ``jaxinfer.engine.runner``) and the quantized
    weights (``jaxinfer.quantization``)."""
    from jaxinfer.cache.metadata import StepMetadata
    from jaxinfer.engine.runner import DecodeState
    from jaxinfer.engine.sampling import SamplingBatch
    from jaxinfer.quantization import QUANTIZED_WEIGHTS

    custom = (StepMetadata, DecodeState, SamplingBatch, *QUANTIZED_WEIGHTS)
    return {"tuple": tuple, "list": list, "dict": dict, "None": type(None),
            **{f"{c.__module__}.{c.__qualname__}": c for c in custom}}


# ---- plain values: JSON keeps no tuples, so they are tagged -------------------------------------

def _value_to_json(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (np.integer, np.bool_)):
        return value.item()
    if isinstance(value, tuple):
        return {"tuple": [_value_to_json(v) for v in value]}
    if isinstance(value, list):
        return [_value_to_json(v) for v in value]
    raise ExportError(f"a program's description holds a {type(value).__name__} ({value!r}), which an export cannot "
                      "store as data")


def _value_from_json(raw):
    if isinstance(raw, dict):
        if set(raw) != {"tuple"} or not isinstance(raw["tuple"], list):
            raise ValueError(f"unexpected object {sorted(raw)!r}")
        return tuple(_value_from_json(v) for v in raw["tuple"])
    if isinstance(raw, list):
        return [_value_from_json(v) for v in raw]
    return raw


# ---- pytree structures ---------------------------------------------------------------------------

def tree_to_json(tree: PyTreeDef):
    """A pytree structure as JSON: ``"*"`` for a leaf, else ``[node type name, aux data, children]``."""
    node = tree.node_data()
    if node is None:
        return "*"
    kind, aux = node
    names = {cls: name for name, cls in _tree_nodes().items()}
    if kind not in names:
        raise ExportError(f"a program's inputs or outputs hold a {kind.__qualname__}, which an export does not "
                          "describe (it may hold the standard containers and the engine's step inputs)")
    return [names[kind], _value_to_json(aux), [tree_to_json(c) for c in tree.children()]]


def tree_from_json(raw) -> PyTreeDef:
    nodes = _tree_nodes()
    if raw == "*":
        return jax.tree.structure(0)
    if not (isinstance(raw, list) and len(raw) == 3 and isinstance(raw[2], list)):
        raise ValueError(f"malformed tree node {str(raw)[:80]!r}")
    name, aux, children = raw
    if name not in nodes:
        raise ValueError(f"unknown tree node type {name!r}")
    return PyTreeDef.from_node_data_and_children(default_registry, (nodes[name], _value_from_json(aux)),
                                                 [tree_from_json(c) for c in children])


# ---- arrays, shardings, layouts ----------------------------------------------------------------

def _abstract_mesh_to_json(mesh) -> dict:
    device = mesh.abstract_device
    return {"axis_sizes": list(mesh.axis_sizes), "axis_names": list(mesh.axis_names),
            "axis_types": [t.name for t in mesh.axis_types],
            "device": None if device is None else {"device_kind": device.device_kind, "num_cores": device.num_cores,
                                                   "platform": device.platform}}


def _abstract_mesh_from_json(raw: dict):
    from jax._src.mesh import AbstractDevice, AbstractMesh
    from jax.sharding import AxisType

    device = raw["device"]
    return AbstractMesh(tuple(int(n) for n in raw["axis_sizes"]), tuple(raw["axis_names"]),
                        tuple(AxisType[t] for t in raw["axis_types"]),
                        abstract_device=None if device is None else AbstractDevice(**device))


def _aval_to_json(aval) -> dict:
    """shape, dtype, weak type, and the aval's own (abstract) sharding and memory space."""
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None and not manual.empty:
        raise ExportError(f"a program's argument {aval} varies over manual mesh axes, which an export does not describe")
    sharding = aval.sharding
    return {"shape": list(aval.shape), "dtype": jnp.dtype(aval.dtype).name, "weak_type": bool(aval.weak_type),
            "mesh": _abstract_mesh_to_json(sharding.mesh), "spec": _spec_to_json(sharding.spec),
            "memory_space": aval.memory_space.name}


def _aval_from_json(raw: dict):
    from jax._src import core

    sharding = NamedSharding(_abstract_mesh_from_json(raw["mesh"]), _spec_from_json(raw["spec"]))
    return core.ShapedArray(tuple(int(n) for n in raw["shape"]), jnp.dtype(raw["dtype"]), bool(raw["weak_type"]),
                            sharding=sharding, memory_space=core.MemorySpace[raw["memory_space"]])


def _spec_to_json(spec) -> list:
    if getattr(spec, "unreduced", None) or getattr(spec, "reduced", None):
        raise ExportError(f"a program's partition spec {spec} has unreduced axes, which an export does not describe")
    return [list(a) if isinstance(a, tuple) else a for a in spec]


def _spec_from_json(raw: list):
    return PartitionSpec(*(tuple(a) if isinstance(a, list) else a for a in raw))


def _device_ids(devices) -> list[int]:
    return [int(d.id) for d in devices]


def _sharding_to_json(sharding) -> dict:
    from jax._src.sharding_impls import GSPMDSharding

    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        return {"kind": "named", "memory_kind": sharding.memory_kind,
                "axis_names": list(mesh.axis_names), "axis_types": [t.name for t in mesh.axis_types],
                "device_ids": np.asarray(mesh.device_ids).tolist(),
                "spec": _spec_to_json(sharding.spec)}
    if isinstance(sharding, GSPMDSharding):
        proto = sharding._hlo_sharding.to_proto().SerializeToString()
        return {"kind": "gspmd", "memory_kind": sharding.memory_kind, "device_ids": _device_ids(sharding._device_assignment),
                "op_sharding": proto.hex()}
    if isinstance(sharding, SingleDeviceSharding):
        (device,) = sharding.device_set
        return {"kind": "single", "memory_kind": sharding.memory_kind, "device_id": int(device.id)}
    raise ExportError(f"a program has a {type(sharding).__name__}, which an export does not describe")


def _sharding_from_json(raw: dict, devices: dict):
    from jax._src.lib import xla_client as xc
    from jax._src.sharding_impls import GSPMDSharding
    from jax.sharding import AxisType

    kind, memory_kind = raw["kind"], raw["memory_kind"]
    if kind == "named":
        ids = np.asarray(raw["device_ids"], dtype=np.int64)
        mesh = Mesh(np.vectorize(devices.__getitem__, otypes=[object])(ids), tuple(raw["axis_names"]),
                    axis_types=tuple(AxisType[t] for t in raw["axis_types"]))
        return NamedSharding(mesh, _spec_from_json(raw["spec"]), memory_kind=memory_kind)
    if kind == "gspmd":
        proto = xc.OpSharding()
        proto.ParseFromString(bytes.fromhex(raw["op_sharding"]))
        return GSPMDSharding(tuple(devices[i] for i in raw["device_ids"]), xc.HloSharding.from_proto(proto),
                             memory_kind=memory_kind)
    if kind == "single":
        return SingleDeviceSharding(devices[raw["device_id"]], memory_kind=memory_kind)
    raise ValueError(f"unknown sharding kind {kind!r}")


def _layout_to_json(layout) -> dict | None:
    if layout is None:
        return None
    from jax._src.layout import Layout

    if type(layout) is not Layout:
        raise ExportError(f"a program has the layout {layout!r}, which an export does not describe")
    tiling = None if layout.tiling is None else [list(t) for t in layout.tiling]
    return {"major_to_minor": list(layout.major_to_minor), "tiling": tiling,
            "sub_byte_element_size_in_bits": int(layout.sub_byte_element_size_in_bits)}


def _layout_from_json(raw: dict | None):
    if raw is None:
        return None
    from jax._src.layout import Layout

    tiling = None if raw["tiling"] is None else tuple(tuple(int(n) for n in t) for t in raw["tiling"])
    return Layout(tuple(int(n) for n in raw["major_to_minor"]), tiling, int(raw["sub_byte_element_size_in_bits"]))


# ---- the whole program ---------------------------------------------------------------------------

# The fields of jax's UnloadedMeshExecutable this module writes or sets; a jax whose executables
# have other fields is refused when exporting (jax, jaxlib and device kind are fixed by an export).
_FIELDS = ("xla_executable", "device_list", "backend", "input_avals", "input_shardings", "output_avals",
           "output_shardings", "committed", "name", "unordered_effects", "ordered_effects", "keepalive",
           "host_callbacks", "kept_var_idx", "mut", "xla_in_layouts", "dispatch_in_layouts", "xla_out_layouts",
           "all_args_info", "pgle_profiler")


def _unloaded(compiled: jax.stages.Compiled):
    from jax._src.interpreters import pxla

    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    if not isinstance(unloaded, pxla.UnloadedMeshExecutable):
        raise ExportError("this program's executable cannot be serialized (jax keeps no unloaded form of it)")
    names = tuple(f.name for f in dataclasses.fields(unloaded))
    if names != _FIELDS:
        raise ExportError(f"jax {jax.__version__} describes executables with other fields than this jaxinfer "
                          f"knows ({sorted(set(names) ^ set(_FIELDS))}): export with --portable")
    return unloaded


def describe(compiled: jax.stages.Compiled) -> dict:
    """Everything but the executable's bytes, as JSON (``ExportError`` for a program that holds
    state an export cannot describe)."""
    u = _unloaded(compiled)
    held = [name for name in ("unordered_effects", "ordered_effects", "keepalive", "host_callbacks")
            if getattr(u, name)]
    if held or u.mut is not None or compiled._params.const_args:
        raise ExportError(f"program {u.name} has {held or 'mutable or constant arguments'}, which an export cannot "
                          "store as data")
    args_info = jax.tree.leaves(compiled.args_info, is_leaf=lambda x: isinstance(x, jax.stages.ArgInfo))
    debug = u.all_args_info.debug_info if u.all_args_info is not None else None
    return {
        "name": u.name,
        "committed": bool(u.committed),
        "devices": _device_ids(u.device_list),
        "kept_var_idx": sorted(int(i) for i in u.kept_var_idx),
        "inputs": [{**_aval_to_json(a), "sharding": _sharding_to_json(s), "layout": _layout_to_json(l),
                    "dispatch_layout": _layout_to_json(d)}
                   for a, s, l, d in zip(u.input_avals, u.input_shardings, u.xla_in_layouts, u.dispatch_in_layouts,
                                         strict=True)],
        "outputs": [{**_aval_to_json(a), "sharding": _sharding_to_json(s), "layout": _layout_to_json(l)}
                    for a, s, l in zip(u.output_avals, u.output_shardings, u.xla_out_layouts, strict=True)],
        "args": [{**_aval_to_json(a._aval), "donated": bool(a.donated)} for a in args_info],
        "all_args": None if u.all_args_info is None else [_aval_to_json(a) for a in u.all_args_info.in_avals],
        "debug": None if debug is None else {
            "traced_for": debug.traced_for, "func_src_info": debug.func_src_info,
            "arg_names": None if debug.arg_names is None else list(debug.arg_names),
            "result_paths": list(debug.result_paths) if isinstance(debug.result_paths, tuple) else None},
        "in_tree": tree_to_json(compiled.in_tree),
        "out_tree": tree_to_json(compiled.out_tree),
        "no_kwargs": bool(compiled._no_kwargs),
    }


def _rebuild(header: dict, xla_executable, backend, devices: dict) -> jax.stages.Compiled:
    """The ``Compiled`` that ``header`` describes around a loaded XLA executable."""
    from jax._src import core
    from jax._src.interpreters import pxla
    from jax._src.lib import xla_client as xc

    inputs, outputs = header["inputs"], header["outputs"]
    debug = header["debug"]
    all_args_info = None
    if header["all_args"] is not None:
        debug_info = None if debug is None else core.DebugInfo(
            debug["traced_for"], debug["func_src_info"],
            None if debug["arg_names"] is None else tuple(debug["arg_names"]),
            None if debug["result_paths"] is None else tuple(debug["result_paths"]))
        all_args_info = pxla.AllArgsInfo([_aval_from_json(a) for a in header["all_args"]], debug_info)
    unloaded = pxla.UnloadedMeshExecutable(
        xla_executable=xla_executable,
        device_list=xc.DeviceList(tuple(devices[i] for i in header["devices"])),
        backend=backend,
        input_avals=[_aval_from_json(x) for x in inputs],
        input_shardings=[_sharding_from_json(x["sharding"], devices) for x in inputs],
        output_avals=[_aval_from_json(x) for x in outputs],
        output_shardings=[_sharding_from_json(x["sharding"], devices) for x in outputs],
        committed=bool(header["committed"]),
        name=str(header["name"]),
        unordered_effects=[], ordered_effects=[], keepalive=[], host_callbacks=[],
        kept_var_idx={int(i) for i in header["kept_var_idx"]},
        mut=None,
        xla_in_layouts=[_layout_from_json(x["layout"]) for x in inputs],
        dispatch_in_layouts=[_layout_from_json(x["dispatch_layout"]) for x in inputs],
        xla_out_layouts=[_layout_from_json(x["layout"]) for x in outputs],
        all_args_info=all_args_info,
        pgle_profiler=None,
    )
    args_info = [jax.stages.ArgInfo(_aval_from_json(a), bool(a["donated"])) for a in header["args"]]
    in_tree = tree_from_json(header["in_tree"])
    if in_tree.num_leaves != len(args_info):
        raise ValueError(f"the input tree has {in_tree.num_leaves} leaves for {len(args_info)} arguments")
    return jax.stages.Compiled(unloaded.load(), [], in_tree.unflatten(args_info), tree_from_json(header["out_tree"]),
                               no_kwargs=bool(header["no_kwargs"]))


def _same_fields(a, b) -> list[str]:
    """The fields of two unloaded executables that differ (the executable and client aside; a list
    and a tuple of the same items are the same: jax makes either, and reads them as sequences)."""
    def value(x, field):
        v = getattr(x, field)
        return tuple(v) if isinstance(v, list) else v

    skip = {"xla_executable", "backend", "all_args_info"}
    differ = [f for f in _FIELDS if f not in skip and value(a, f) != value(b, f)]
    ai, bi = a.all_args_info, b.all_args_info
    if (ai is None) != (bi is None) or (ai is not None and (list(ai.in_avals) != list(bi.in_avals) or
                                                            ai.debug_info.arg_names != bi.debug_info.arg_names)):
        differ.append("all_args_info")
    return differ


def serialize(compiled: jax.stages.Compiled) -> bytes:
    """The file's bytes for ``compiled``. The description is rebuilt and compared with the program's
    own fields first, so a program is written only in a form that loads as the same program."""
    unloaded = _unloaded(compiled)
    header = describe(compiled)
    devices = {int(d.id): d for d in unloaded.device_list}
    rebuilt = _rebuild(json.loads(json.dumps(header)), unloaded.xla_executable, unloaded.backend, devices)
    differ = _same_fields(unloaded, rebuilt._executable._unloaded_executable)
    if differ or rebuilt.in_tree != compiled.in_tree or rebuilt.out_tree != compiled.out_tree:
        raise ExportError(f"program {unloaded.name} does not round-trip through its description "
                          f"({differ or 'pytree structures'}); export with --portable")
    executable = unloaded.xla_executable
    payload = executable.client.serialize_executable(executable) if hasattr(executable, "client") else \
        executable.serialize()
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    return MAGIC + _LENGTH.pack(len(text)) + text + bytes(payload)


def _split(data: bytes) -> tuple[dict, bytes]:
    """(header, executable bytes); ``ValueError`` for anything but a file ``serialize`` wrote."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _LENGTH.size:
        raise ValueError("not a jaxinfer executable file")
    (length,) = _LENGTH.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _LENGTH.size
    if length > MAX_HEADER_BYTES or start + length > len(data):
        raise ValueError(f"a header of {length} bytes does not fit the file")
    header = json.loads(data[start:start + length].decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header, data[start + length:]


def deserialize(data: bytes, execution_devices) -> jax.stages.Compiled:
    """Load a file ``serialize`` wrote onto ``execution_devices`` (the export's mesh, in order).
    ``ExportError`` for a malformed file; XLA's own errors (another jax, device or build) pass
    through for the caller to name."""
    try:
        header, payload = _split(data)
        devices = {int(d.id): d for d in execution_devices}
        wanted = [int(i) for i in header["devices"]]
        if any(i not in devices for i in wanted):
            raise ValueError(f"it runs on devices {wanted}; this mesh has {sorted(devices)}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as e:
        raise ExportError(f"malformed executable file: {e}") from e
    backend = execution_devices[0].client
    from jax._src.lib import xla_client as xc

    xla_executable = backend.deserialize_executable(
        payload, executable_devices=xc.DeviceList(tuple(devices[i] for i in wanted)))
    try:
        return _rebuild(header, xla_executable, backend, devices)
    except (ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
        raise ExportError(f"malformed executable file: {type(e).__name__}: {e}") from e
