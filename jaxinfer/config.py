"""Typed model configuration, read from ``config.json`` the way transformers reads it.

``config.json`` goes through transformers' own config class for its ``model_type`` (never code from
the checkpoint), so every default is HF's. ``ModelConfig`` is a typed, validated view of the fields
every decoder shares; the rest of the HF config is kept in ``extra`` (with HF's defaults filled in),
read by a family through the typed getters (``int_field``, ``float_field``, ...), which check type and
range as they read. Every bad value raises ``ConfigError`` naming the field, the value and what is
allowed, before anything is allocated.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import warnings
from typing import Any

from jaxinfer import checks
from jaxinfer.checkpoint_folder import CheckpointFolder
from jaxinfer.errors import ConfigError
from jaxinfer.quantization import parse as parse_quantization

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# Model types whose checkpoints need a later transformers than the oldest one jaxinfer supports
# (pyproject's lower bound, 5.17): there, their config class is missing (``sarvam_mla``) or its
# validator refuses what the checkpoints hold (``layer_types: indexed_attention``). The version is
# the one they are tested with.
TRANSFORMERS_NEEDED = {"deepseek_v32": "5.24", "glm_moe_dsa": "5.24", "hy_v4": "5.24", "sarvam_mla": "5.24"}
_REQUIRED = object()


def _rope_number(params: dict, key: str, **bounds) -> float | None:
    return checks.optional(checks.number, params.get(key), f"rope_parameters.{key}", **bounds)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters: HF's standardised ``rope_parameters`` (which transformers builds
    from ``rope_parameters``, or the older ``rope_theta`` + ``rope_scaling``), checked."""

    rope_type: str = "default"
    theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    # llama3
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    # yarn
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # yarn / longrope
    attention_factor: float | None = None
    # longrope
    long_factor: tuple[float, ...] | None = None
    short_factor: tuple[float, ...] | None = None

    @classmethod
    def from_hf(cls, params: Any, max_position_embeddings: int) -> "RopeConfig":
        if not isinstance(params, dict):
            raise ConfigError(f"rope_parameters must be a mapping, got {params!r}")
        if any(isinstance(v, dict) for v in params.values()):
            raise ConfigError(
                "per-layer-type rope_parameters are not supported by this model family yet: "
                f"{sorted(params)}"
            )
        rope_type = params.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        required = {
            "linear": ("factor",),
            "dynamic": ("factor",),
            "longrope": ("long_factor", "short_factor", "original_max_position_embeddings"),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            "yarn": ("original_max_position_embeddings",),
        }.get(rope_type, ())
        missing = [k for k in required if params.get(k) is None]
        if missing:
            raise ConfigError(f"rope type {rope_type!r} needs {missing} in rope_parameters/rope_scaling")
        theta = checks.number(params.get("rope_theta"), "rope_parameters.rope_theta", gt=0)
        if rope_type == "yarn" and theta == 1:
            raise ConfigError("rope_parameters.rope_theta must not be 1 for yarn (it divides by log(theta))")
        partial = _rope_number(params, "partial_rotary_factor", gt=0, le=1)
        orig = checks.optional(checks.integer, params.get("original_max_position_embeddings"),
                               "rope_parameters.original_max_position_embeddings", ge=1)
        factor = _rope_number(params, "factor", gt=0)
        if rope_type == "yarn" and factor is None:
            factor = max_position_embeddings / orig  # as HF: the ratio of the two lengths
        low = _rope_number(params, "low_freq_factor", gt=0)
        high = _rope_number(params, "high_freq_factor", gt=0)
        if rope_type == "llama3" and high <= low:
            raise ConfigError(
                f"rope_parameters.high_freq_factor ({high}) must be greater than low_freq_factor ({low}) for llama3"
            )

        def factors(key):
            value = params.get(key)
            if value is None:
                return None
            if not isinstance(value, (list, tuple)) or not value:
                raise ConfigError(f"rope_parameters.{key} must be a non-empty list of numbers, got {value!r}")
            return tuple(checks.number(v, f"rope_parameters.{key}[{i}]", gt=0) for i, v in enumerate(value))

        return cls(
            rope_type=rope_type,
            theta=theta,
            partial_rotary_factor=1.0 if partial is None else partial,
            factor=factor,
            original_max_position_embeddings=orig,
            low_freq_factor=low,
            high_freq_factor=high,
            beta_fast=_rope_number(params, "beta_fast", gt=0),
            beta_slow=_rope_number(params, "beta_slow", gt=0),
            mscale=_rope_number(params, "mscale", gt=0),
            mscale_all_dim=_rope_number(params, "mscale_all_dim", gt=0),
            truncate=checks.boolean(params.get("truncate", True), "rope_parameters.truncate"),
            attention_factor=_rope_number(params, "attention_factor", gt=0),
            long_factor=factors("long_factor"),
            short_factor=factors("short_factor"),
        )

    def check_rotary_dim(self, head_dim: int) -> int:
        """The rotated width of a head of ``head_dim`` (HF's ``int(head_dim * partial_rotary_factor)``),
        checked: RoPE rotates halves, so it must be even, and each longrope factor list has one
        entry per rotated pair."""
        dim = int(head_dim * self.partial_rotary_factor)
        least = 4 if self.rope_type == "dynamic" else 2  # dynamic NTK divides by (dim - 2)
        if dim < least or dim % 2:
            raise ConfigError(
                f"the rotary width int(head_dim * partial_rotary_factor) = int({head_dim} * "
                f"{self.partial_rotary_factor}) = {dim} must be an even number >= {least}"
            )
        for key in ("long_factor", "short_factor"):
            value = getattr(self, key)
            if value is not None and len(value) != dim // 2:
                raise ConfigError(f"rope_parameters.{key} has {len(value)} entries; a rotary width of {dim} "
                                  f"needs {dim // 2}")
        return dim


def _hf_config_class(raw: Any):
    """transformers' config class for ``raw["model_type"]``; ``ConfigError`` for a config that is not an
    object, or a model type that only code shipped with the checkpoint (``auto_map``) defines."""
    from transformers import __version__ as transformers_version
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not isinstance(raw, dict):
        raise ConfigError(f"config.json must hold a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(f"config.json needs a 'model_type' string naming a transformers model, got {model_type!r}")
    _check_transformers_version(model_type, transformers_version)
    if model_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[model_type]
    auto_map = raw.get("auto_map")
    if isinstance(auto_map, dict) and auto_map:
        raise ConfigError(
            f"model_type {model_type!r} is defined by code shipped with the checkpoint (auto_map: "
            f"{sorted(auto_map)}); jaxinfer never runs code from a checkpoint (remote code stays off). Use a "
            "checkpoint of a model type transformers knows"
        )
    raise ConfigError(f"model_type {model_type!r} is unknown to transformers {transformers_version}")


def _check_transformers_version(model_type: str, installed: str) -> None:
    """``ConfigError`` when ``model_type`` needs a later transformers than ``installed``
    (``TRANSFORMERS_NEEDED``), before transformers reads the config."""
    from packaging.version import Version

    needed = TRANSFORMERS_NEEDED.get(model_type)
    if needed is not None and Version(installed) < Version(needed):
        raise ConfigError(f"model_type {model_type!r} needs transformers >= {needed} (installed: {installed}), whose "
                          f"config class reads its checkpoints: pip install 'transformers>={needed}'")


def _rejected(config_class, error: Exception) -> ConfigError:
    message = " ".join(str(error).split())
    return ConfigError(f"config.json is rejected by transformers' {config_class.__name__}: {message}")


def _check_before_transformers(raw: dict, config_class) -> None:
    """The fields transformers' config classes compute the layer pattern from as they are built
    (``full_attention_interval``, Kimi-Linear's ``linear_attn_config``), checked first: a bad one is
    named here rather than failing inside transformers or making a wrong pattern there."""
    for part in (raw, raw.get("text_config")):
        if isinstance(part, dict):
            checks.optional(checks.integer, part.get("full_attention_interval"), "full_attention_interval", ge=1)
    if raw.get("model_type") != "kimi_linear" or "linear_attn_config" not in raw:
        return
    linear = raw["linear_attn_config"]
    if not isinstance(linear, dict):
        raise ConfigError("linear_attn_config must be a mapping (kda_layers, full_attn_layers, num_heads, head_dim, "
                          f"short_conv_kernel_size), got {linear!r}")
    n = checks.integer(raw.get("num_hidden_layers", config_class.num_hidden_layers), "num_hidden_layers", ge=1)
    kda, full = (checks.optional(checks.integer_list, linear.get(key), f"linear_attn_config.{key}", ge=1, le=n)
                 for key in ("kda_layers", "full_attn_layers"))  # 1-indexed
    if raw.get("layer_types") is None and kda is not None and full is not None:  # transformers derives layer_types
        if sorted(kda + full) != list(range(1, n + 1)):
            raise ConfigError(f"linear_attn_config.kda_layers {list(kda)} and full_attn_layers {list(full)} must name "
                              f"each of the layers 1..{n} exactly once")


def hf_config_from_dict(raw: Any):
    """The contents of a ``config.json`` -> the transformers config object, as ``AutoConfig`` builds it."""
    config_class = _hf_config_class(raw)
    _check_before_transformers(raw, config_class)
    try:  # a deep copy: transformers edits nested dicts (rope_parameters) in place
        return config_class.from_dict(copy.deepcopy(raw))
    except Exception as e:  # transformers' own validation: a wrong type, a missing rope key, ...
        raise _rejected(config_class, e) from e


def hf_config_from_folder(folder: CheckpointFolder):
    """``AutoConfig.from_pretrained`` of the folder: local files only, remote code off."""
    raw = folder.read_json("config.json")
    if raw is None:
        raise ConfigError(f"no config.json in {folder.path!r}: point at a HuggingFace checkpoint folder")
    config_class = _hf_config_class(raw)
    _check_before_transformers(raw, config_class)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder.path, local_files_only=True, trust_remote_code=False)
    except Exception as e:
        raise _rejected(config_class, e) from e


def eos_id_list(value: Any, name: str, vocab_size: int) -> tuple[int, ...]:
    """EOS ids (one or a list of non-negative integers) that the model can emit. Ids beyond the
    vocabulary can never be sampled, so they are dropped with a warning (transformers also only warns)."""
    if value is None:
        return ()
    ids = checks.integer_list(value if isinstance(value, (list, tuple)) else [value], name, ge=0)
    beyond = [i for i in ids if i >= vocab_size]
    if beyond:
        warnings.warn(f"{name} {beyond} lies beyond the vocabulary ({vocab_size} tokens) and can never be "
                      "generated; it is ignored", stacklevel=3)
    return tuple(i for i in ids if i < vocab_size)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The fields every decoder reads, typed and checked; ``extra`` is the whole HF config as a dict
    (defaults filled in), ``hf`` the transformers config object itself."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    rope: RopeConfig  # with per-layer-type rope_parameters: the full-attention layers'
    dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    rope_by_layer_type: tuple[tuple[str, RopeConfig], ...] = ()  # (layer type, its RoPE) where they differ
    extra: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    hf: Any = dataclasses.field(default=None, compare=False, repr=False)  # the transformers config object
    # The text config as config.json writes it, before transformers renames old values ("mamba").
    written: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    quantization: Any = None  # jaxinfer.quantization.Fp8Quantization of an fp8 checkpoint, else None

    def rope_for(self, layer_type: str | None) -> RopeConfig:
        """The RoPE of layers of ``layer_type`` ("sliding_attention", ...): its own where
        ``rope_parameters`` is given per layer type, else the model's one."""
        return dict(self.rope_by_layer_type).get(layer_type, self.rope)

    # ---- typed reads of any other field ------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        """A raw config value (HF's, defaults included), or ``default`` when absent or null."""
        value = self.extra.get(key)
        return default if value is None else value

    def _lookup(self, keys: tuple[str, ...], default: Any) -> tuple[str | None, Any]:
        """(key, value) of the first of ``keys`` that is set; (None, default) when none is, and
        ``ConfigError`` naming them all when there is no default."""
        for key in keys:
            if self.extra.get(key) is not None:
                return key, self.extra[key]
        if default is _REQUIRED:
            raise ConfigError(f"config.json of a {self.model_type} model needs {' or '.join(map(repr, keys))}")
        return None, default

    def require(self, *keys: str) -> Any:
        """The first of ``keys`` that is set (HF renames some keys between versions)."""
        return self._lookup(keys, _REQUIRED)[1]

    def int_field(self, *keys: str, default: Any = _REQUIRED, ge: int | None = None, le: int | None = None):
        """The first of ``keys`` that is set, checked to be an integer in ``[ge, le]``; ``default`` when
        none is set (``ConfigError`` when there is no default)."""
        key, value = self._lookup(keys, default)
        return value if key is None else checks.integer(value, key, ge=ge, le=le)

    def float_field(self, key: str, default: Any = _REQUIRED, **bounds):
        """``key`` checked to be a finite number within ``bounds`` (``checks.number``'s), else ``default``."""
        found, value = self._lookup((key,), default)
        return value if found is None else checks.number(value, key, **bounds)

    def bool_field(self, key: str, default: Any = _REQUIRED):
        found, value = self._lookup((key,), default)
        return value if found is None else checks.boolean(value, key)

    def int_list_field(self, key: str, **bounds) -> tuple[int, ...]:
        """``key`` checked to be a list of integers within ``bounds``; () when unset."""
        value = self.get(key)
        return () if value is None else checks.integer_list(value, key, **bounds)

    def layer_kinds(self, key: str, allowed: tuple[str, ...], default: str | None = None) -> tuple[str, ...]:
        """``key`` (``layer_types``, ``mlp_layer_types``, ...) checked to list one of ``allowed`` per
        layer, as config.json writes it: transformers reads some old names as new ones ("mamba" as
        "linear_attention"), which no family here writes. ``default`` for every layer when unset."""
        n, read, written = self.num_hidden_layers, self.get(key), self.written.get(key)
        kinds = read if written is None else written
        if kinds is None and default is not None:
            return (default,) * n
        names = " or ".join(map(repr, allowed))
        if not isinstance(kinds, (list, tuple)) or len(kinds) != n:
            raise ConfigError(f"{key} must list {names} for each of the {n} layers, got {kinds!r}")
        bad = [i for i, kind in enumerate(kinds) if kind not in allowed]
        if bad:
            values = ", ".join(dict.fromkeys(repr(kinds[i]) for i in bad))
            first, hint = bad[0], ""
            if kinds is written and isinstance(read, (list, tuple)) and len(read) == n and read[first] in allowed:
                hint = f" (transformers reads {kinds[first]!r} as {read[first]!r}: write that if it is meant)"
            raise ConfigError(f"{key} holds {values}; {self.model_type} layers are {names}{hint}")
        return tuple(kinds)

    # ---- construction ------------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf, written: dict | None = None) -> "ModelConfig":
        """The typed view of a transformers config object (its text model's, for multimodal wrappers);
        ``written``: the config.json it was read from."""
        architectures = getattr(hf, "architectures", None)
        if not architectures or not isinstance(architectures, (list, tuple)) or not isinstance(architectures[0], str):
            raise ConfigError(
                f"config.json needs an 'architectures' list naming the model class, got {architectures!r}"
            )
        text = hf.get_text_config()
        raw = text.to_dict()
        quantization = parse_quantization(written or {})
        if text is not hf:  # a multimodal wrapper: its text model's part
            written = (written or {}).get("text_config")
        # ``to_dict`` writes an ``attribute_map`` alias under its target's name (Kimi-Linear stores
        # ``max_position_embeddings`` as ``model_max_length``); the alias reads the same, as in HF.
        for alias, target in getattr(type(text), "attribute_map", {}).items():
            if raw.get(alias) is None and raw.get(target) is not None:
                raw[alias] = raw[target]
        sizes = {key: checks.integer(raw.get(key), key, ge=1)
                 for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                             "max_position_embeddings")}
        heads = sizes["num_attention_heads"]
        kv_heads = checks.integer(raw.get("num_key_value_heads") or heads, "num_key_value_heads", ge=1)
        if raw.get("head_dim") is not None:
            head_dim = checks.integer(raw["head_dim"], "head_dim", ge=1)
        elif sizes["hidden_size"] < heads:
            raise ConfigError(f"head_dim is unset and hidden_size ({sizes['hidden_size']}) is smaller than "
                              f"num_attention_heads ({heads}): head_dim = hidden_size // heads would be 0")
        else:
            head_dim = sizes["hidden_size"] // heads  # HF's default
        rotary_dim = raw.get("rotary_dim")  # MiniMax-M2's; transformers makes it partial_rotary_factor * head_dim
        if rotary_dim is not None and not (checks.is_integer(rotary_dim) and 2 <= rotary_dim <= head_dim
                                           and rotary_dim % 2 == 0):
            raise ConfigError(f"rotary_dim must be an even integer >= 2 and <= head_dim ({head_dim}), got {rotary_dim!r}")
        intermediate = raw.get("intermediate_size")
        hidden_act = raw.get("hidden_act", "silu")
        if not isinstance(hidden_act, str):
            raise ConfigError(f"hidden_act must be an activation name, got {hidden_act!r}")
        dtype = raw.get("dtype", raw.get("torch_dtype"))
        ropes = {}  # rope_parameters given per layer type (Gemma3: local and global RoPE)
        params = raw.get("rope_parameters")
        if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
            ropes = {kind: RopeConfig.from_hf(v, sizes["max_position_embeddings"]) for kind, v in params.items()}
        return cls(
            architecture=architectures[0],
            model_type=raw.get("model_type", ""),
            vocab_size=sizes["vocab_size"],
            hidden_size=sizes["hidden_size"],
            intermediate_size=checks.optional(checks.integer, intermediate, "intermediate_size", ge=1) or 0,
            num_hidden_layers=sizes["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=sizes["max_position_embeddings"],
            rms_norm_eps=checks.number(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", gt=0),
            hidden_act=hidden_act,
            tie_word_embeddings=checks.boolean(raw.get("tie_word_embeddings", False), "tie_word_embeddings"),
            rope=ropes.get("full_attention", next(iter(ropes.values()))) if ropes else RopeConfig.from_hf(
                raw.get("rope_parameters") or {"rope_theta": 10000.0}, sizes["max_position_embeddings"]),
            rope_by_layer_type=tuple(sorted(ropes.items())),
            dtype=str(dtype) if dtype is not None else None,
            bos_token_id=checks.optional(checks.integer, raw.get("bos_token_id"), "bos_token_id", ge=0),
            eos_token_ids=eos_id_list(raw.get("eos_token_id"), "eos_token_id", sizes["vocab_size"]),
            extra=raw,
            hf=hf,
            written=written if isinstance(written, dict) else {},
            quantization=quantization,
        )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """From the contents of a ``config.json``, read through transformers' class for its model type."""
        return cls.from_hf(hf_config_from_dict(raw), raw)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike | CheckpointFolder) -> "ModelConfig":
        """From a checkpoint folder's ``config.json`` (confined to the folder, never remote code)."""
        folder = path if isinstance(path, CheckpointFolder) else CheckpointFolder(path)
        return cls.from_hf(hf_config_from_folder(folder), folder.read_json("config.json"))
