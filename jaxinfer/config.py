"""Typed model configuration read from a HuggingFace ``config.json``.

``ModelConfig`` holds the fields every decoder shares, typed and validated; everything else in the
file is kept verbatim in ``extra`` (read it with ``config.get(key, default)``), so a family can read
its own knobs without this module knowing them. Bad or missing values raise ``ConfigError`` naming
the key.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jaxinfer.errors import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, normalised from either ``rope_parameters`` (transformers 5)
    or the older ``rope_theta`` + ``rope_scaling`` pair."""

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
    def from_hf(cls, raw: dict[str, Any]) -> "RopeConfig":
        params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        if any(isinstance(v, dict) for v in params.values()):
            raise ConfigError(
                "per-layer-type rope_parameters are not supported by this model family yet: "
                f"{sorted(params)}"
            )
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
        if partial is None and raw.get("rotary_dim"):
            # Legacy field (MiniMax-M2 checkpoints): rotate the first rotary_dim dims of each head.
            head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
            partial = raw["rotary_dim"] / head_dim
        partial = 1.0 if partial is None else partial
        orig = params.get("original_max_position_embeddings")
        if rope_type in ("llama3", "yarn", "longrope"):
            # Phi-3 style configs keep the pretraining length at the top level; it wins (as in HF).
            orig = raw.get("original_max_position_embeddings", orig) or raw.get("max_position_embeddings")
        required = {
            "linear": ("factor",),
            "dynamic": ("factor",),
            "yarn": (),
            "longrope": ("long_factor", "short_factor"),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
        }.get(rope_type, ())
        missing = [k for k in required if params.get(k) is None]
        if missing:
            raise ConfigError(f"rope type {rope_type!r} needs {missing} in rope_parameters/rope_scaling")
        factor = params.get("factor")
        if rope_type == "yarn" and factor is None:
            factor = raw["max_position_embeddings"] / orig
        tuple_or_none = lambda v: tuple(float(x) for x in v) if v is not None else None  # noqa: E731
        return cls(
            rope_type=rope_type,
            theta=float(theta),
            partial_rotary_factor=float(partial),
            factor=None if factor is None else float(factor),
            original_max_position_embeddings=None if orig is None else int(orig),
            low_freq_factor=params.get("low_freq_factor"),
            high_freq_factor=params.get("high_freq_factor"),
            beta_fast=params.get("beta_fast"),
            beta_slow=params.get("beta_slow"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
            attention_factor=params.get("attention_factor"),
            long_factor=tuple_or_none(params.get("long_factor")),
            short_factor=tuple_or_none(params.get("short_factor")),
        )


def _as_id_list(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
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
    rope: RopeConfig
    dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    def get(self, key: str, default: Any = None) -> Any:
        """A raw config value (any key of config.json), or ``default`` when absent or null."""
        value = self.extra.get(key)
        return default if value is None else value

    def require(self, *keys: str) -> Any:
        """The first of ``keys`` that config.json sets (aliases: HF renames some keys between
        versions); ``ConfigError`` naming them all when none is set."""
        for key in keys:
            if self.extra.get(key) is not None:
                return self.extra[key]
        raise ConfigError(f"config.json of a {self.model_type} model needs {' or '.join(map(repr, keys))}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        raw = dict(raw)
        # Multimodal wrappers keep the decoder under text_config; serve that.
        if isinstance(raw.get("text_config"), dict) and "hidden_size" not in raw:
            raw = {**raw["text_config"], "architectures": raw.get("architectures")}
        architectures = raw.get("architectures") or []
        if not architectures:
            raise ConfigError("config.json has no 'architectures' entry; cannot tell which model to build")
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(raw.get(key), int) or raw[key] <= 0:
                raise ConfigError(f"config.json needs a positive integer {key!r}, got {raw.get(key)!r}")
        heads = raw["num_attention_heads"]
        kv_heads = raw.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ConfigError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        dtype = raw.get("dtype", raw.get("torch_dtype"))
        return cls(
            architecture=architectures[0],
            model_type=raw.get("model_type", ""),
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=int(raw.get("intermediate_size") or 4 * raw["hidden_size"]),
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(raw.get("max_position_embeddings") or 2048),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            hidden_act=raw.get("hidden_act", "silu"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope=RopeConfig.from_hf(raw),
            dtype=dtype if isinstance(dtype, str) else None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_id_list(raw.get("eos_token_id")),
            extra=raw,
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        config_path = os.path.join(os.fspath(path), "config.json")
        if not os.path.isfile(config_path):
            raise ConfigError(f"no config.json in {os.fspath(path)!r}: point at a HuggingFace checkpoint folder")
        with open(config_path) as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{config_path} is not valid JSON: {e}") from e
        return cls.from_dict(raw)
