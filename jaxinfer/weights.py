"""safetensors checkpoints -> parameter pytrees of (sharded) device arrays.

Tensors are read one at a time through safetensors' memory map and each device receives only its
own slice (``jax.make_array_from_callback``), so the checkpoint is never held twice in host memory.
Before anything is read, the checkpoint's names and shapes are checked against the model's: missing,
unexpected and mis-shaped tensors are all reported together, by name.
"""

from __future__ import annotations

import glob
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from safetensors import safe_open

from jaxinfer.cache.layout import KVCacheLayout
from jaxinfer.cache.metadata import AttentionMetadata
from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError
from jaxinfer.sharding import param_sharding

INDEX_FILE = "model.safetensors.index.json"


class SafetensorsCheckpoint:
    """The tensors of a checkpoint folder: one ``*.safetensors`` file, several, or an index."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        index = os.path.join(self.path, INDEX_FILE)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(self.path, "*.safetensors")))
            weight_map = None
        if not files:
            raise CheckpointError(f"no *.safetensors files in {self.path!r}")
        self._handles = {}
        for name in files:
            file_path = os.path.join(self.path, name)
            if not os.path.isfile(file_path):
                raise CheckpointError(f"{INDEX_FILE} lists {name!r}, which is not in {self.path!r}")
            self._handles[name] = safe_open(file_path, framework="numpy")
        if weight_map is None:
            weight_map = {key: name for name, handle in self._handles.items() for key in handle.keys()}
        self._file_of = weight_map

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._file_of[name]].get_slice(name).get_shape())

    def read(self, name: str, index=None) -> np.ndarray:
        """The tensor (or the slice ``index`` of it) as a numpy array in its stored dtype."""
        handle = self._handles[self._file_of[name]]
        if index is None:
            return handle.get_tensor(name)
        return handle.get_slice(name)[index]


def _dummy_inputs(model_cls, config: ModelConfig):
    """Smallest inputs that trace the model, for ``jax.eval_shape`` of ``init``."""
    layout = KVCacheLayout(model_cls.kv_cache_specs(config), page_size=1, num_pages=1, dtype=jnp.float32)
    caches = [tuple(jnp.zeros(layout.page_shape(s)) for _ in "kv") for s in layout.layer_specs]
    one = jnp.zeros((1,), jnp.int32)
    md = AttentionMetadata(positions=one, slot_mapping=one, token_seq_ids=one,
                           block_tables=jnp.zeros((1, 1), jnp.int32), seq_lens=one + 1, logits_indices=one)
    return one, md, caches


def expected_params(model_cls, config: ModelConfig, dtype) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
    """Flat {path: ShapeDtypeStruct} of the model's parameters, from an abstract ``init``."""
    model = model_cls(config, dtype)
    variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *_dummy_inputs(model_cls, config)))
    return traverse_util.flatten_dict(variables["params"])


def init_params(model_cls, config: ModelConfig, seed: int = 0, dtype=jnp.float32):
    """Random parameters (HF-style init: normal(0.02) matrices, unit norms). For tiny checkpoints."""
    model = model_cls(config, dtype)
    return jax.jit(lambda key: model.init(key, *_dummy_inputs(model_cls, config)))(jax.random.PRNGKey(seed))["params"]


class Tensor:
    """A parameter stored as one checkpoint tensor, as is."""

    def __init__(self, name: str):
        self.names = (name,)

    def shape(self, checkpoint: SafetensorsCheckpoint) -> tuple[int, ...]:
        return checkpoint.shape(self.names[0])

    def read(self, checkpoint: SafetensorsCheckpoint, index) -> np.ndarray:
        return checkpoint.read(self.names[0], index)


class Stacked:
    """A parameter whose leading axis gathers one checkpoint tensor each (per-expert MoE weights)."""

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

    ``fn(*arrays)`` returns the parameter; ``shape_fn(*shapes)`` its shape without reading data.
    """

    def __init__(self, names: list[str], fn, shape_fn):
        self.names, self.fn, self.shape_fn = tuple(names), fn, shape_fn

    def shape(self, checkpoint: SafetensorsCheckpoint) -> tuple[int, ...]:
        return tuple(self.shape_fn(*(checkpoint.shape(n) for n in self.names)))

    def read(self, checkpoint: SafetensorsCheckpoint, index) -> np.ndarray:
        value = self.fn(*(checkpoint.read(n) for n in self.names))
        return value if index is None else value[index]


def _describe(items: list[str], limit: int = 12) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" ... and {len(items) - limit} more" if len(items) > limit else "")


def check_checkpoint(checkpoint: SafetensorsCheckpoint, model_cls, config: ModelConfig, expected) -> dict:
    """Match the model's parameters to checkpoint tensors; raise ``CheckpointError`` naming every
    missing, unexpected and mis-shaped tensor. Returns {param path: source}."""
    ignored = [re.compile(p) for p in model_cls.ignored_checkpoint_keys_for(config)]
    available = set(checkpoint.names())
    sources = model_cls.checkpoint_sources(config, expected, available)
    missing, misshaped = [], []
    for path, source in sources.items():
        absent = [n for n in source.names if n not in available]
        if absent:
            missing.extend(absent)
            continue
        shape, want = tuple(source.shape(checkpoint)), tuple(expected[path].shape)
        if shape != want:
            what = source.names[0] if len(source.names) == 1 else f"{source.names[0]} (+{len(source.names) - 1} more)"
            misshaped.append(f"{what}: checkpoint gives {list(shape)}, model expects {list(want)}")
    used = {n for source in sources.values() for n in source.names}
    unexpected = sorted(n for n in available - used if not any(p.search(n) for p in ignored))
    problems = []
    if missing:
        problems.append(f"missing tensors: {_describe(sorted(missing))}")
    if unexpected:
        problems.append(f"unexpected tensors: {_describe(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped tensors: {_describe(misshaped)}")
    if problems:
        raise CheckpointError(
            f"checkpoint {checkpoint.path!r} does not match {config.architecture} as configured by its "
            "config.json; " + "; ".join(problems)
        )
    return sources


def load_params(path, model_cls, config: ModelConfig, dtype, mesh, *, progress: bool = False):
    """Check, then stream every tensor into a device array with its ``NamedSharding``."""
    checkpoint = SafetensorsCheckpoint(path)
    expected = expected_params(model_cls, config, dtype)
    sources = check_checkpoint(checkpoint, model_cls, config, expected)
    items = list(expected.items())
    if progress:
        from tqdm.auto import tqdm

        items = tqdm(items, desc="loading weights", unit="tensor")
    flat = {}
    for param_path, struct in items:
        source = sources[param_path]
        sharding = param_sharding(param_path, struct.shape, mesh)
        # Each parameter takes the dtype the model declares for it (the serving dtype, or float32 where
        # a model keeps one in full precision).
        flat[param_path] = jax.make_array_from_callback(
            struct.shape, sharding,
            lambda index, source=source, dtype=np.dtype(struct.dtype): source.read(checkpoint, index).astype(dtype),
        )
    return traverse_util.unflatten_dict(flat)
