"""Checkpoint folder -> a ready model: config, implementation, parameters on a mesh.

``load_model`` is the research handle (no engine): ``load_model(path).logits([1, 2, 3])`` runs one
full causal forward through the same model code and paged-attention ops the engine serves with.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cache.layout import CacheLayout
from jaxinfer.cache.metadata import AttentionMetadata, build_metadata
from jaxinfer import checks
from jaxinfer.checkpoint_folder import CheckpointFolder
from jaxinfer.config import ModelConfig
from jaxinfer.errors import ConfigError, InvalidRequestError
from jaxinfer.kernels import registry as kernel_registry
from jaxinfer.registry import ModelRegistry
from jaxinfer.sharding import make_mesh
from jaxinfer.weights import TEXT_MODEL_LAYOUTS, SafetensorsCheckpoint, load_params

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(dtype, config: ModelConfig):
    """The serving dtype: a name (``"bfloat16"``), a dtype, or ``"auto"``, the checkpoint's own dtype
    (float32 when it does not say)."""
    asked = dtype
    if dtype in (None, "auto"):
        dtype = config.dtype or "float32"
    if not isinstance(dtype, str):
        try:
            dtype = np.dtype(dtype).name
        except TypeError:
            pass
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    said = f" (the checkpoint's dtype, asked for by {asked!r})" if asked in (None, "auto") else ""
    raise ConfigError(f"dtype {dtype!r}{said} is not supported; use one of auto, {', '.join(_DTYPES)}")


def validate_token_ids(token_ids, vocab_size: int, what: str = "prompt") -> list[int]:
    """``token_ids`` as a list of ints: a sequence (or 1-D integer array) of Python or numpy integers
    in ``[0, vocab_size)``. Floats, bools and strings are refused, not coerced."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or not np.issubdtype(token_ids.dtype, np.integer):
            raise InvalidRequestError(f"the {what} must be a 1-D array of integers, got {token_ids.dtype} "
                                      f"of shape {token_ids.shape}")
        token_ids = token_ids.tolist()
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, (list, tuple)):
        raise InvalidRequestError(f"the {what} must be a list of token ids, got {type(token_ids).__name__}")
    wrong = [t for t in token_ids if not checks.is_integer(t)]
    if wrong:
        raise InvalidRequestError(f"the {what} must hold integer token ids; it holds {wrong[:4]!r} "
                                  f"({', '.join(sorted({type(t).__name__ for t in wrong}))})")
    ids = [int(t) for t in token_ids]
    if not ids:
        raise InvalidRequestError(f"the {what} is empty: give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"the {what} has token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}"
        )
    return ids


@dataclasses.dataclass
class LoadedModel:
    path: str
    config: ModelConfig
    model_cls: type
    model: object  # the flax module
    params: dict
    mesh: jax.sharding.Mesh
    dtype: type
    _forwards: dict = dataclasses.field(default_factory=dict, repr=False)

    def apply(self, token_ids, md: AttentionMetadata, caches, *, all_logits: bool = False):
        """The pure model function: (params, inputs, caches) -> (float32 logits, caches)."""
        return self.model.apply({"params": self.params}, token_ids, md, caches, all_logits=all_logits)

    def _full_forward(self):
        """The jitted one-sequence forward for the kernel selection in force (choices are made while
        tracing, so each selection has its own)."""
        chosen = kernel_registry.selection(kernel_registry.target_for(self.mesh))
        if chosen not in self._forwards:
            def run(params, token_ids):
                t = token_ids.shape[0]
                page_size = 16
                num_pages = -(-t // page_size)
                layout = CacheLayout(self.model_cls.cache_specs(self.config), page_size, num_pages, self.dtype,
                                     num_slots=1)
                md = build_metadata(jnp.zeros((1,), jnp.int32), jnp.full((1,), t, jnp.int32),
                                    jnp.arange(num_pages, dtype=jnp.int32)[None, :], page_size=page_size,
                                    num_tokens=t, state_slots=jnp.zeros((1,), jnp.int32), xp=jnp)
                with kernel_registry.applied(chosen):
                    logits, _ = self.model.apply({"params": params}, token_ids, md, layout.zeros(), all_logits=True)
                return logits

            self._forwards[chosen] = jax.jit(run)
        return self._forwards[chosen]

    def logits(self, token_ids) -> np.ndarray:
        """float32 logits [num_tokens, vocab] of one causal forward over ``token_ids``."""
        ids = validate_token_ids(token_ids, self.config.vocab_size, "token sequence")
        return np.asarray(self._full_forward()(self.params, jnp.asarray(ids, jnp.int32)))


def open_checkpoint(path: str | os.PathLike):
    """Read and check everything about a checkpoint folder that needs no device: its config (through
    transformers' class), the implementation, the tensor headers against the config. Returns
    ``(config, model_cls, checkpoint)``; raises before any array exists."""
    folder = CheckpointFolder(path)
    config = ModelConfig.from_pretrained(folder)
    model_cls = ModelRegistry.resolve(config.architecture)
    checkpoint = SafetensorsCheckpoint(folder)
    checkpoint.use_layout(TEXT_MODEL_LAYOUTS)
    model_cls.check_checkpoint_layout(config, checkpoint)
    model_cls.validate_config(config)
    return config, model_cls, checkpoint


def load_model(path: str | os.PathLike, dtype="float32", *, mesh=None, progress: bool = False) -> LoadedModel:
    path = os.fspath(path)
    config, model_cls, checkpoint = open_checkpoint(path)
    dtype = resolve_dtype(dtype, config)
    mesh = mesh if mesh is not None else make_mesh()
    params = load_params(checkpoint, model_cls, config, dtype, mesh, progress=progress)
    return LoadedModel(path, config, model_cls, model_cls(config, dtype), params, mesh, dtype)
