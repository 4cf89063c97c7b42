"""Checkpoint folder -> a ready model: config, implementation, parameters on a mesh.

``load_model`` is the research handle (no engine): ``load_model(path).logits([1, 2, 3])`` runs one
full causal forward through the same model code and paged-attention ops the engine serves with;
``forward(ids, capture=...)`` also returns what happens inside (``jaxinfer.research``), and
``prompt_logprobs(ids)`` each token's log-probability given its prefix.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cache.metadata import AttentionMetadata
from jaxinfer import checks
from jaxinfer.checkpoint_folder import CheckpointFolder
from jaxinfer.config import ModelConfig
from jaxinfer.errors import ConfigError, InvalidRequestError
from jaxinfer.registry import ModelRegistry
from jaxinfer.research import forward as research_forward
from jaxinfer.research.request import CAPTURES, CaptureRequest, layer_captures
from jaxinfer.research.request import parse as parse_capture
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


def sequences_of(token_ids, vocab_size: int) -> tuple[list[list[int]], bool]:
    """One sequence (a list or 1-D array of token ids) or a batch (a list of them, or a 2-D integer
    array) -> (the checked sequences, whether a batch was given)."""
    if isinstance(token_ids, np.ndarray) and token_ids.ndim == 2:
        token_ids = list(token_ids)
    batch = (isinstance(token_ids, (list, tuple)) and len(token_ids) > 0
             and all(isinstance(ids, (list, tuple, np.ndarray)) for ids in token_ids))
    if not batch:
        return [validate_token_ids(token_ids, vocab_size, "token sequence")], False
    return [validate_token_ids(ids, vocab_size, f"token sequence {i} of the batch")
            for i, ids in enumerate(token_ids)], True


@dataclasses.dataclass
class LoadedModel:
    """A checkpoint's model and parameters, for research: full causal forwards over one sequence or
    a batch, with captures of what happens inside (``jaxinfer.research``). Inputs are padded to
    power-of-two buckets, so a new length within a bucket reuses the forward compiled before."""

    path: str
    config: ModelConfig
    model_cls: type
    model: object  # the flax module
    params: dict
    mesh: jax.sharding.Mesh
    dtype: type
    _forwards: dict = dataclasses.field(default_factory=dict, repr=False)  # the compiled research programs

    def apply(self, token_ids, md: AttentionMetadata, caches, *, all_logits: bool = False):
        """The pure model function: (params, inputs, caches) -> (float32 logits, caches)."""
        return self.model.apply({"params": self.params}, token_ids, md, caches, all_logits=all_logits)

    def logits(self, token_ids):
        """float32 logits [num_tokens, vocab] of one causal forward over ``token_ids``; for a batch
        (a list of sequences), a list of them, one per sequence."""
        sequences, batched = sequences_of(token_ids, self.config.vocab_size)
        batch, outputs = research_forward.run(self, sequences, CaptureRequest())
        out = [outputs["logits"][batch.rows(s)] for s in range(len(sequences))]
        return out if batched else out[0]

    def captures(self) -> dict[str, tuple[int, ...] | None]:
        """What ``forward`` can capture here: capture name -> the layers that have it (None for
        ``hidden_states``, which covers every layer). It is itself a ``capture`` of everything."""
        available = layer_captures(research_forward.decoder_layers(self), self.config)
        out = {"hidden_states": None}
        for name in CAPTURES:
            layers = tuple(i for i, names in enumerate(available) if name in names)
            if layers:
                out[name] = layers
        return out

    def forward(self, token_ids, capture=None):
        """One causal forward over a sequence (or a batch of sequences of any lengths) -> a
        ``ForwardResult`` (a list of them for a batch), with logits and the captures asked for.

        ``capture``: a name, a list of names, or ``{name: layers}`` (None: every layer that has it),
        of ``hidden_states``, ``attentions``, ``router_logits``, ``selected_experts``,
        ``routing_weights``, ``indexer_selections``, ``recurrent_states``; see ``ForwardResult``.
        """
        sequences, batched = sequences_of(token_ids, self.config.vocab_size)
        request = CaptureRequest()
        if capture is not None:
            request = parse_capture(capture, research_forward.decoder_layers(self), self.config)
        batch, outputs = research_forward.run(self, sequences, request)
        out = [research_forward.unpack(batch, outputs, request, s, ids) for s, ids in enumerate(sequences)]
        return out if batched else out[0]

    def prompt_logprobs(self, token_ids):
        """Each prompt token's log-probability given the tokens before it, ``[None, lp_1, ...,
        lp_{n-1}]`` as vLLM's ``prompt_logprobs`` (the first token has no prefix); a list of them for
        a batch."""
        sequences, batched = sequences_of(token_ids, self.config.vocab_size)
        batch, outputs = research_forward.run(self, sequences, CaptureRequest(), logits=False, logprobs=True)
        out = [research_forward.prompt_logprobs(batch, outputs, s) for s in range(len(sequences))]
        return out if batched else out[0]


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
