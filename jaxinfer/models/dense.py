"""Dense decoders: Llama, Mistral, Qwen2 and Qwen3.

They differ only in biases on q/k/v and o, per-head q/k RMSNorm (Qwen3), and which layers use a
sliding window (Mistral: all of them when ``sliding_window`` is set; Qwen2/3: ``layer_types``, or
the layers ``>= max_window_layers`` when ``use_sliding_window``).
"""

from __future__ import annotations

from jaxinfer.config import ModelConfig
from jaxinfer.errors import ConfigError
from jaxinfer.models.decoder import AttentionSpec, DecoderForCausalLM, DecoderSpec, LayerSpec, layer_windows

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _qwen_windows(config: ModelConfig) -> tuple[int | None, ...]:
    if config.get("layer_types") is not None:
        return layer_windows(config)
    n, window = config.num_hidden_layers, config.get("sliding_window")
    use = config.get("use_sliding_window", False) and window is not None
    start = config.get("max_window_layers", n)
    return tuple(window if use and i >= start else None for i in range(n))


class DenseDecoderForCausalLM(DecoderForCausalLM):
    """Llama / Mistral / Qwen2 / Qwen3 (``*ForCausalLM``)."""

    @classmethod
    def spec(cls, config: ModelConfig) -> DecoderSpec:
        kind = config.model_type
        if kind not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {config.model_type!r} is not a dense family this class serves "
                f"({', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if kind == "mistral":
            windows = layer_windows(config, default_sliding=True)
        elif kind in ("qwen2", "qwen3"):
            windows = _qwen_windows(config)
        else:
            windows = (None,) * config.num_hidden_layers
        attention_bias = bool(config.get("attention_bias", False))
        mlp_bias = bool(config.get("mlp_bias", False)) if kind == "llama" else False
        return DecoderSpec(tuple(
            LayerSpec(
                AttentionSpec(
                    qkv_bias=True if kind == "qwen2" else attention_bias,
                    o_bias=False if kind == "qwen2" else attention_bias,
                    qk_norm="head" if kind == "qwen3" else None,
                    sliding_window=w,
                ),
                mlp_bias=mlp_bias,
            )
            for w in windows
        ))
