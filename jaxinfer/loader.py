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
from flax import traverse_util
from jax.sharding import PartitionSpec

from jaxinfer.cache.checkpoint_scales import read_kv_scales
from jaxinfer.cache.layout import CacheLayout
from jaxinfer.cache.metadata import StepMetadata
from jaxinfer import checks
from jaxinfer.checkpoint_folder import CheckpointFolder
from jaxinfer.config import ModelConfig
from jaxinfer.errors import ConfigError, InvalidRequestError
from jaxinfer.quantization import Fp8Checkpoint
from jaxinfer.registry import ModelRegistry
from jaxinfer.research import forward as research_forward
from jaxinfer.research.request import CAPTURES, CaptureRequest, layer_captures
from jaxinfer.research.request import parse as parse_capture
from jaxinfer.sharding.for_model import plan_for
from jaxinfer.sharding.forward import REPLICATED, param_specs, sharded
from jaxinfer.sharding.plan import BATCH, ShardingPlan
from jaxinfer.weights import TEXT_MODEL_LAYOUTS, SafetensorsCheckpoint, declared_params, load_params

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
    power-of-two buckets, so a new length within a bucket reuses the forward compiled before.

    The parameters are partitioned as ``plan`` says (``jaxinfer.sharding``); ``param_axes`` holds
    each one's logical axes ({path: axes}), as its layer declares them."""

    path: str
    config: ModelConfig
    model_cls: type
    model: object  # the flax module
    params: dict
    plan: ShardingPlan
    dtype: type
    param_axes: dict
    kv_scales: tuple = ()  # per layer, the KV-cache scales the checkpoint gives (jaxinfer.cache.checkpoint_scales)
    _forwards: dict = dataclasses.field(default_factory=dict, repr=False)  # the compiled research programs

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.plan.mesh

    @property
    def rows_spec(self) -> PartitionSpec:
        """The ``PartitionSpec`` of a step's inputs and outputs split by row over the data-parallel ranks."""
        return self.plan.spec((BATCH,))

    def per_device(self, fn, cache_specs, *, rows=REPLICATED, outputs=REPLICATED):
        """``fn(params, token_ids, md, caches) -> (outputs, caches)`` run on each device's pieces
        (``jaxinfer.sharding.forward``): parameters and caches partitioned as declared (``cache_specs``:
        the caches' ``PartitionSpec``s), the step inputs as ``rows`` says (``rows_spec``: each
        data-parallel rank its own rows; ``REPLICATED``: every rank all of them) and ``outputs`` put
        together as it says."""
        return sharded(self.plan, fn, in_specs=(param_specs(self.plan, self.param_axes, self.params), rows, rows,
                                                cache_specs),
                       out_specs=(outputs, cache_specs))

    def check_partitioning(self, param_shapes: dict) -> None:
        """Trace the per-device forward abstractly (nothing is allocated): a count a layer cannot
        split over the plan's devices is a ``ConfigError`` here, before any weight is read."""
        from jaxinfer.weights import dummy_inputs

        token_ids, md, _ = dummy_inputs(self.model_cls, self.config)
        ranks = self.plan.data_parallel  # one page and slot per rank
        layout = CacheLayout(self.model_cls.cache_specs(self.config), page_size=1, num_pages=ranks,
                             dtype=jnp.float32, num_slots=ranks)
        for layer in range(len(layout.layer_specs)):
            for name, (shape, _, axes) in layout.layer_arrays(layer).items():
                uneven = [f"dim {d} ({n}, {a})" for d, (n, a) in enumerate(zip(shape, axes))
                          if n % self.plan.ways(a)]
                if uneven:
                    raise ConfigError(f"layer {layer}'s cache array {name!r} does not split over "
                                      f"tensor_parallel_size = {self.plan.tensor_parallel}: {', '.join(uneven)}; "
                                      "choose a tensor_parallel_size that divides its head count")
        params = traverse_util.unflatten_dict(param_shapes)
        jax.eval_shape(lambda p: self.apply(p, token_ids, md, layout.zeros(), layout.partition_specs(self.plan)),
                       params)

    def apply(self, params, token_ids, md: StepMetadata, caches, cache_specs, *, all_logits: bool = False):
        """The model function on the mesh: (params, inputs, caches) -> (float32 logits, caches)."""
        def forward(params, token_ids, md, caches):
            return self.model.apply({"params": params}, token_ids, md, caches, all_logits=all_logits)
        return self.per_device(forward, cache_specs)(params, token_ids, md, caches)

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
    if config.quantization is not None:  # fp8 weights read as the floats they stand for
        checkpoint = Fp8Checkpoint(checkpoint, config.quantization)
    model_cls.check_checkpoint_layout(config, checkpoint)
    model_cls.validate_config(config)
    return config, model_cls, checkpoint


QUANTIZATION_MODES = ("auto", None)


def check_quantization_mode(quantization) -> None:
    """``ConfigError`` unless ``quantization`` is one of ``QUANTIZATION_MODES``."""
    if not (quantization is None or (isinstance(quantization, str) and quantization in QUANTIZATION_MODES)):
        raise ConfigError(f"quantization must be 'auto' (kept as the checkpoint stores it) or None (dequantized "
                          f"to dtype on load), got {quantization!r}")


def load_model(path: str | os.PathLike, dtype="float32", *, quantization: str | None = "auto",
               tensor_parallel_size: int = 1, data_parallel_size: int = 1, enable_expert_parallel: bool = False,
               mesh=None, progress: bool = False) -> LoadedModel:
    """The checkpoint at ``path`` on ``tensor_parallel_size`` devices (or a custom ``mesh`` from
    ``jaxinfer.sharding.make_mesh``); every count is checked before a weight is read.
    ``quantization``: "auto" keeps a quantized checkpoint's weights quantized on the device where
    their layers take them (``jaxinfer.quantization``), None dequantizes them to ``dtype`` on load."""
    check_quantization_mode(quantization)
    path = os.fspath(path)
    config, model_cls, checkpoint = open_checkpoint(path)
    dtype = resolve_dtype(dtype, config)
    shapes, axes = declared_params(model_cls, config, dtype)
    plan = plan_for(model_cls, config, shapes, axes, mesh=mesh, tensor_parallel_size=tensor_parallel_size,
                    data_parallel_size=data_parallel_size, enable_expert_parallel=enable_expert_parallel)
    loaded = LoadedModel(path, config, model_cls, model_cls(config, dtype), None, plan, dtype, axes)
    loaded.check_partitioning(shapes)
    loaded.kv_scales = read_kv_scales(checkpoint, model_cls.cache_specs(config))
    loaded.params = load_params(checkpoint, model_cls, config, plan, shapes, axes,
                                keep_quantized=quantization == "auto", progress=progress)
    return loaded


def in_memory_model(model_cls, config: ModelConfig, params: dict, dtype, *, path: str = "<in memory>") -> LoadedModel:
    """A ``LoadedModel`` of parameters made in memory (random weights for a benchmark), on one device."""
    shapes, axes = declared_params(model_cls, config, dtype)
    plan = plan_for(model_cls, config, shapes, axes)
    return LoadedModel(path, config, model_cls, model_cls(config, dtype), params, plan, dtype, axes)
