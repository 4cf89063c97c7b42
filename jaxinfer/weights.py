"""safetensors checkpoints -> parameter pytrees of (sharded) device arrays.

Tensors are read one at a time through safetensors' memory map and each device receives only its
own slice (``jax.make_array_from_callback``), so the checkpoint is never held twice in host memory.
Only safetensors files are read (never a pickle), each one confined to the checkpoint folder
(``jaxinfer.checkpoint_folder``). Before anything is read, the checkpoint's names, shapes and dtypes
(from the files' headers) are checked against the model's: missing, unexpected, duplicated,
mis-shaped and non-floating tensors are all reported together, by name. After loading, one
reduction per tensor on the device refuses NaN / Inf weights.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re

import jax
import jax.numpy as jnp
import flax.linen as nn
import ml_dtypes
import numpy as np
from flax import traverse_util
from safetensors import safe_open

from jaxinfer.cache.layout import CacheLayout
from jaxinfer.cache.metadata import build_metadata
from jaxinfer.checkpoint_folder import CheckpointFolder
from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError, ConfigError
from jaxinfer.quantization import Fp8Checkpoint, Mxfp4Tensor
from jaxinfer.sharding.plan import ShardingPlan

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors dtype names a float weight may be stored in
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Stored dtypes safetensors' numpy reader does not give: read from the file's bytes instead.
FLOAT8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def _describe(items: list[str], limit: int = 12) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" ... and {len(items) - limit} more" if len(items) > limit else "")


def _weight_map(folder: CheckpointFolder) -> dict[str, str] | None:
    """The index's {tensor: file}, checked to be a mapping of names to safetensors file names."""
    index = folder.read_json(INDEX_FILE, CheckpointError)
    if index is None:
        return None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{INDEX_FILE} in {folder.path!r} has no 'weight_map' object of tensor -> file")
    bad = [f"{k!r}: {v!r}" for k, v in weight_map.items()
           if not isinstance(v, str) or not v.endswith(".safetensors")]
    if bad:
        raise CheckpointError(f"{INDEX_FILE} in {folder.path!r} maps tensors to entries that are not "
                              f"safetensors file names: {_describe(bad)}")
    return weight_map


class SafetensorsCheckpoint:
    """The tensors of a checkpoint folder: one ``*.safetensors`` file, several, or an index."""

    def __init__(self, path: str | os.PathLike | CheckpointFolder):
        folder = path if isinstance(path, CheckpointFolder) else CheckpointFolder(path)
        self.path = folder.path
        weight_map = _weight_map(folder)
        files = sorted(set(weight_map.values())) if weight_map else \
            [n for n in folder.names() if n.endswith(".safetensors")]
        if not files:
            pickles = [n for n in folder.names() if n.endswith(PICKLE_SUFFIXES) or n.endswith(".bin.index.json")]
            if pickles:
                raise CheckpointError(
                    f"{self.path!r} holds PyTorch pickle weights ({_describe(pickles)}) and no *.safetensors "
                    "files; jaxinfer never unpickles (loading a pickle can run code): convert the checkpoint "
                    "to safetensors"
                )
            raise CheckpointError(f"no *.safetensors files in {self.path!r}")
        self._handles = {}
        self._paths = {}  # file -> its real path
        self._headers = {}  # file -> (where its data starts, its header), read when a float8 tensor is
        for name in files:
            real = folder.resolve(name, what="weight file")
            if real is None:
                raise CheckpointError(f"{INDEX_FILE} lists {name!r}, which is not in {self.path!r}")
            try:
                self._handles[name] = safe_open(real, framework="numpy")
            except Exception as e:  # safetensors' own header validation
                raise CheckpointError(f"{os.path.join(self.path, name)} is not a valid safetensors file: {e}") from e
            self._paths[name] = real
        self._file_of = self._locate(weight_map)
        self._stored_name = {}  # canonical name -> name in the files, where a name layout renames

    def _locate(self, weight_map: dict[str, str] | None) -> dict[str, str]:
        """{tensor: file}; ``CheckpointError`` for a tensor stored twice or an index the files contradict."""
        found: dict[str, list[str]] = {}
        for file, handle in self._handles.items():
            for key in handle.keys():
                found.setdefault(key, []).append(file)
        twice = sorted(f"{k} (in {', '.join(v)})" for k, v in found.items() if len(v) > 1)
        if twice:
            raise CheckpointError(f"checkpoint {self.path!r} stores tensors more than once: {_describe(twice)}")
        file_of = {k: v[0] for k, v in found.items()}
        if weight_map is not None:
            wrong = sorted(f"{k} (index: {f}, stored in: {file_of.get(k, 'no file')})"
                           for k, f in weight_map.items() if file_of.get(k) != f)
            unlisted = sorted(set(file_of) - set(weight_map))
            if wrong or unlisted:
                problems = ([f"tensors not where the index says: {_describe(wrong)}"] if wrong else []) + \
                           ([f"tensors the index does not list: {_describe(unlisted)}"] if unlisted else [])
                raise CheckpointError(f"{INDEX_FILE} in {self.path!r} disagrees with its files: " + "; ".join(problems))
        return file_of

    def use_layout(self, layouts: tuple["NameLayout", ...]) -> "NameLayout":
        """Name the tensors as the model does (``model.*``, ``lm_head.*``) under whichever of ``layouts``
        maps the most stored names there (the first, on a tie); names it does not rewrite stay as
        stored. -> the layout taken."""
        stored = list(self._file_of)

        def text_names(layout):
            return sum(layout.to_canonical(n).startswith(("model.layers.", "model.embed_tokens.", "model.norm.",
                                                          "lm_head.")) for n in stored)

        layout = max(layouts, key=text_names)  # max keeps the first of equal scores
        if layout.rewrites:
            canonical = {layout.to_canonical(name): name for name in stored}
            if len(canonical) != len(stored):
                raise CheckpointError(f"checkpoint {self.path!r} names a tensor twice once its text-model prefix "
                                      f"is taken off ({layout.rewrites})")
            self._stored_name = canonical
            self._file_of = {name: self._file_of[raw] for name, raw in canonical.items()}
        return layout

    def _slice(self, name: str):
        return self._handles[self._file_of[name]].get_slice(self._stored_name.get(name, name))

    def _float8(self, name: str) -> np.ndarray:
        """A float8 tensor as a read-only memory map of its bytes (safetensors checked the header's
        offsets when the file was opened)."""
        file = self._file_of[name]
        if file not in self._headers:
            with open(self._paths[file], "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                self._headers[file] = (8 + size, json.loads(f.read(size)))
        start, header = self._headers[file]
        entry = header[self._stored_name.get(name, name)]
        begin, end = entry["data_offsets"]
        dtype = FLOAT8_DTYPES[entry["dtype"]]
        if end == begin:
            return np.zeros(entry["shape"], dtype)
        data = np.memmap(self._paths[file], dtype=np.uint8, mode="r", offset=start + begin, shape=(end - begin,))
        return data.view(dtype).reshape(entry["shape"])

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype's safetensors name (``F32``, ``BF16``, ``I64``, ``U8``, ...)."""
        return self._slice(name).get_dtype()

    def read(self, name: str, index=None) -> np.ndarray:
        """The tensor (or the slice ``index`` of it) as a numpy array in its stored dtype."""
        if self.dtype(name) in FLOAT8_DTYPES:
            array = self._float8(name)
            return np.array(array if index is None else array[index])
        if index is None:
            return self._handles[self._file_of[name]].get_tensor(self._stored_name.get(name, name))
        return self._slice(name)[index]


@dataclasses.dataclass(frozen=True)
class NameLayout:
    """How a checkpoint names the text model's tensors: ``rewrites`` of (our prefix, its prefix), the
    first that matches applying. Multimodal wrappers keep the text model under a prefix."""

    rewrites: tuple[tuple[str, str], ...] = ()

    def to_stored(self, name: str) -> str:
        for ours, theirs in self.rewrites:
            if name.startswith(ours):
                return theirs + name[len(ours):]
        return name

    def to_canonical(self, name: str) -> str:
        for ours, theirs in self.rewrites:
            if name.startswith(theirs):
                return ours + name[len(theirs):]
        return name


# The layouts a text model's tensors come in: plain (``model.*``, ``lm_head.*``); the hub layout of
# LLaVA-style wrappers (``language_model.model.*``, Kimi K2.5; transformers writes its layers as
# ``blocks``); transformers' own layout of multimodal models (``model.language_model.*``, Qwen3.5).
TEXT_MODEL_LAYOUTS = (
    NameLayout(),
    NameLayout((("model.", "language_model.model."), ("lm_head.", "language_model.lm_head."))),
    NameLayout((("model.layers.", "language_model.model.blocks."), ("model.", "language_model.model."),
                ("lm_head.", "language_model.lm_head."))),
    NameLayout((("model.", "model.language_model."),)),
)


def dummy_inputs(model_cls, config: ModelConfig):
    """Smallest inputs that trace the model, for ``jax.eval_shape`` of ``init``."""
    layout = CacheLayout(model_cls.cache_specs(config), page_size=1, num_pages=1, dtype=jnp.float32, num_slots=1)
    one = jnp.zeros((1,), jnp.int32)
    md = build_metadata(one, one + 1, jnp.zeros((1, 1), jnp.int32), page_size=1, num_tokens=1, state_slots=one,
                        xp=jnp)
    return one, md, layout.zeros()


def declared_params(model_cls, config: ModelConfig, dtype) -> tuple[dict, dict]:
    """From an abstract ``init``: flat {path: ShapeDtypeStruct} of the model's parameters, and flat
    {path: the logical axis of each dimension} as its layers declare them (``jaxinfer.sharding``;
    None for a dimension every device holds whole)."""
    model = model_cls(config, dtype)
    variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *dummy_inputs(model_cls, config)))
    boxed = traverse_util.flatten_dict(variables["params"])
    shapes = {path: nn.unbox(value) for path, value in boxed.items()}
    axes = {path: tuple(value.names) if isinstance(value, nn.Partitioned) else (None,) * len(shapes[path].shape)
            for path, value in boxed.items()}
    return shapes, axes


def expected_params(model_cls, config: ModelConfig, dtype) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
    """Flat {path: ShapeDtypeStruct} of the model's parameters, from an abstract ``init``."""
    return declared_params(model_cls, config, dtype)[0]


def init_params(model_cls, config: ModelConfig, seed: int = 0, dtype=jnp.float32):
    """Random parameters (HF-style init: normal(0.02) matrices, unit norms). For tiny checkpoints."""
    model = model_cls(config, dtype)
    init = jax.jit(lambda key: nn.unbox(model.init(key, *dummy_inputs(model_cls, config))["params"]))
    return init(jax.random.PRNGKey(seed))


class Tensor:
    """A parameter stored as one checkpoint tensor, as is."""

    dtypes = FLOAT_DTYPES  # the stored dtypes it may be read from

    def __init__(self, name: str):
        self.names = (name,)

    def shape(self, checkpoint: SafetensorsCheckpoint) -> tuple[int, ...]:
        return checkpoint.shape(self.names[0])

    def read(self, checkpoint: SafetensorsCheckpoint, index) -> np.ndarray:
        return checkpoint.read(self.names[0], index)


class Stacked:
    """A parameter whose leading axis gathers one checkpoint tensor each (per-expert MoE weights)."""

    dtypes = FLOAT_DTYPES

    def __init__(self, names: list[str]):
        self.names = tuple(names)

    def shape(self, checkpoint: SafetensorsCheckpoint) -> tuple[int, ...]:
        shapes = {checkpoint.shape(n) for n in self.names}
        if len(shapes) != 1:
            raise CheckpointError(f"tensors {self.names[0]} ... {self.names[-1]} differ in shape: {sorted(shapes)}")
        return (len(self.names), *shapes.pop())

    def read(self, checkpoint: SafetensorsCheckpoint, index) -> np.ndarray:
        index = tuple(index) if index is not None else (slice(None),)
        rows = range(len(self.names))[index[0]]
        return np.stack([checkpoint.read(self.names[i], index[1:] or None) for i in rows])


class Derived:
    """A parameter computed from whole checkpoint tensors (a re-layout or a dequantisation).

    ``fn(*arrays)`` returns the parameter; ``shape_fn(*shapes)`` its shape without reading data;
    ``dtypes`` the stored dtypes the inputs may have (floats, unless the source dequantises).
    """

    def __init__(self, names: list[str], fn, shape_fn, dtypes: tuple[str, ...] = FLOAT_DTYPES):
        self.names, self.fn, self.shape_fn, self.dtypes = tuple(names), fn, shape_fn, dtypes

    def shape(self, checkpoint: SafetensorsCheckpoint) -> tuple[int, ...]:
        return tuple(self.shape_fn(*(checkpoint.shape(n) for n in self.names)))

    def read(self, checkpoint: SafetensorsCheckpoint, index) -> np.ndarray:
        value = self.fn(*(checkpoint.read(n) for n in self.names))
        return value if index is None else value[index]


_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_layout(checkpoint: SafetensorsCheckpoint, config: ModelConfig, ignored: tuple[str, ...] = ()) -> None:
    """Config sizes against the checkpoint's tensor names and header shapes, read in milliseconds
    before the model is traced: the layer indices and the embedding matrix (tensors matching an
    ``ignored`` regex left out). ``ConfigError`` naming the field."""
    patterns = [re.compile(p) for p in ignored]
    names = [n for n in checkpoint.names() if not any(p.search(n) for p in patterns)]
    layers = sorted({int(m.group(1)) for m in map(_LAYER_NAME.search, names) if m})
    n = config.num_hidden_layers
    if layers and layers != list(range(n)):
        held = f"{len(layers)} layers, {layers[0]}..{layers[-1]}" if layers == list(range(len(layers))) else \
            f"layers {_describe([str(i) for i in layers])}"
        raise ConfigError(f"num_hidden_layers is {n}, but the checkpoint's tensors hold {held}")
    embeddings = [name for name in names if name.endswith("embed_tokens.weight")]
    if len(embeddings) == 1:
        shape = checkpoint.shape(embeddings[0])
        for axis, field in enumerate(("vocab_size", "hidden_size")):
            want = getattr(config, field)
            if len(shape) != 2 or shape[axis] != want:
                raise ConfigError(f"{field} is {want}, but the checkpoint's {embeddings[0]} has shape {list(shape)} "
                                  "([vocab_size, hidden_size])")


def check_checkpoint(checkpoint: SafetensorsCheckpoint, model_cls, config: ModelConfig, expected) -> dict:
    """Match the model's parameters to checkpoint tensors; raise ``CheckpointError`` naming every
    missing, unexpected and mis-shaped tensor. Returns {param path: source}."""
    ignored = [re.compile(p) for p in model_cls.ignored_checkpoint_keys_for(config)]
    skipped = [(re.compile(p), what) for p, what in model_cls.skipped_checkpoint_keys_for(config)]
    available = set(checkpoint.names())
    sources = model_cls.checkpoint_sources(config, expected, available)
    missing, misshaped, wrong_dtype = [], [], []
    for path, source in sources.items():
        absent = [n for n in source.names if n not in available]
        if absent:
            missing.extend(absent)
            continue
        if jnp.issubdtype(expected[path].dtype, jnp.floating):
            wrong_dtype.extend(f"{n} ({checkpoint.dtype(n)}; expected one of {', '.join(source.dtypes)})"
                               for n in source.names if checkpoint.dtype(n) not in source.dtypes)
        shape, want = tuple(source.shape(checkpoint)), tuple(expected[path].shape)
        if shape != want:
            what = source.names[0] if len(source.names) == 1 else f"{source.names[0]} (+{len(source.names) - 1} more)"
            misshaped.append(f"{what}: checkpoint gives {list(shape)}, model expects {list(want)}")
    used = {n for source in sources.values() for n in source.names}
    left = available - used
    for pattern, what in skipped:
        matched = sorted(n for n in left if pattern.search(n))
        if matched:
            logger.warning("not serving %s: %d checkpoint tensors skipped (%s, ...)", what, len(matched), matched[0])
            left -= set(matched)
    unexpected = sorted(n for n in left if not any(p.search(n) for p in ignored))
    problems = []
    if missing:
        problems.append(f"missing tensors: {_describe(sorted(missing))}")
    if unexpected:
        problems.append(f"unexpected tensors: {_describe(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped tensors: {_describe(misshaped)}")
    if wrong_dtype:
        problems.append(f"tensors of a dtype the model cannot load as weights: {_describe(sorted(wrong_dtype))}")
    if problems:
        raise CheckpointError(
            f"checkpoint {checkpoint.path!r} does not match {config.architecture} as configured by its "
            "config.json; " + "; ".join(problems)
        )
    return sources


def all_finite(arrays) -> list:
    """One bool per parameter (an array, or the arrays of a quantized weight): no NaN / Inf in it (the
    loaded weights' check; an export compiles it too)."""
    return [jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(a)])) for a in arrays]


_all_finite = jax.jit(all_finite)


def check_finite(flat: dict, sources: dict, all_finite=None) -> None:
    """``CheckpointError`` naming every loaded tensor of ``flat`` ({param path: array}) that holds NaN
    or Inf (after the cast to its serving dtype): one reduction per parameter on the device, one
    result fetched. ``all_finite``: that reduction (arrays -> one bool each, in ``flat``'s order);
    by default the jitted one here, an export brings its own compiled one."""
    finite = jax.device_get((all_finite or _all_finite)(list(flat.values())))
    bad = [", ".join(sources[path].names) + f" ({flat[path].dtype})"
           for path, ok in zip(flat, finite) if not ok]
    if bad:
        raise CheckpointError(f"tensors hold NaN or Inf values (as loaded): {_describe(sorted(bad))}")


def stream_params(checkpoint: SafetensorsCheckpoint, sources: dict, expected: dict, shardings: dict, *,
                  progress: bool = False) -> dict:
    """{param path: device array}: each checked tensor streamed into its sharding (only the
    device's slice read), in the dtype the model declares for it (the serving dtype, or float32
    where a model keeps one in full precision)."""
    items = list(expected.items())
    if progress:
        from tqdm.auto import tqdm

        items = tqdm(items, desc="loading weights", unit="tensor")
    flat = {}
    for param_path, struct in items:
        source = sources[param_path]
        flat[param_path] = jax.make_array_from_callback(
            struct.shape, shardings[param_path],
            lambda index, source=source, dtype=np.dtype(struct.dtype): source.read(checkpoint, index).astype(dtype),
        )
    return flat


def quantized_streams(checkpoint: SafetensorsCheckpoint, sources: dict, expected: dict, param_axes: dict,
                      plan: ShardingPlan) -> dict:
    """{param path: a function streaming it onto the devices quantized} for each weight that stays
    quantized where its layer takes it: an fp8 checkpoint's (``jaxinfer.quantization.Fp8Weight``)
    and MXFP4 experts (``Mxfp4Weight``), where each device's piece keeps whole blocks. Decided from
    the headers alone."""
    kept = {}
    for path, source in sources.items():
        shape, axes = expected[path].shape, param_axes[path]
        if isinstance(source, Mxfp4Tensor) and source.keeps(shape, axes, plan):
            kept[path] = functools.partial(source.stream, checkpoint, shape, axes, plan)
        elif (isinstance(checkpoint, Fp8Checkpoint) and isinstance(source, (Tensor, Stacked))
              and checkpoint.keeps(path, source.names, shape, axes, plan)):
            kept[path] = functools.partial(checkpoint.stream, source.names, isinstance(source, Stacked), shape,
                                           axes, plan)
    return kept


def load_params(checkpoint: SafetensorsCheckpoint, model_cls, config: ModelConfig, plan: ShardingPlan,
                expected: dict, param_axes: dict, *, keep_quantized: bool = True, progress: bool = False):
    """Check, then stream every tensor (``expected``, ``param_axes``: ``declared_params``) into a
    device array with its sharding under ``plan`` (each device reads only its slice); then refuse
    non-finite weights. With ``keep_quantized``, the weights of ``quantized_streams`` stay quantized
    on the device; the others are dequantized."""
    sources = check_checkpoint(checkpoint, model_cls, config, expected)
    kept = quantized_streams(checkpoint, sources, expected, param_axes, plan) if keep_quantized else {}
    flat = stream_all(checkpoint, sources, expected, {path: plan.sharding(param_axes[path]) for path in expected},
                      kept, progress=progress)
    check_finite(flat, sources)
    return traverse_util.unflatten_dict(flat)


def stream_all(checkpoint: SafetensorsCheckpoint, sources: dict, expected: dict, shardings: dict, kept: dict, *,
               progress: bool = False) -> dict:
    """{param path: device array or quantized weight} in ``expected``'s order: the ``kept`` ones
    (``quantized_streams``) streamed quantized, the others by ``stream_params``."""
    rest = {path: struct for path, struct in expected.items() if path not in kept}
    flat = stream_params(checkpoint, sources, rest, {path: shardings[path] for path in rest}, progress=progress)
    for path, stream in kept.items():
        flat[path] = stream()
    return {path: flat[path] for path in expected}
