"""Dense decoders: Llama, Mistral, Qwen2 and Qwen3.

They differ only in biases on q/k/v and o, per-head q/k RMSNorm (Qwen3), and which layers use a
sliding window (Mistral: all of them when ``sliding_window`` is set; Qwen2/3: ``layer_types``, or
the layers ``>= max_window_layers`` when ``use_sliding_window``).
"""

from __future__ import annotations

from jaxinfer.config import ModelConfig
from jaxinfer.errors import ConfigError
from jaxinfer.models.decoder import (DecoderForCausalLM, DecoderSpec, DenseMLP, LayerSpec, layer_windows,
                                     sliding_window)
from jaxinfer.models.layers.attention import GQA

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _windows(config: ModelConfig) -> tuple[int | None, ...]:
    """Mistral slides every layer when ``sliding_window`` is set (it ignores ``layer_types``); Qwen2/3
    slide the "sliding_attention" layers of ``layer_types``, which HF's config class derives from
    ``use_sliding_window`` and ``max_window_layers`` when the checkpoint does not list them."""
    if config.model_type == "mistral":
        return (sliding_window(config),) * config.num_hidden_layers
    if config.model_type in ("qwen2", "qwen3"):
        return layer_windows(config)
    return (None,) * config.num_hidden_layers


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
        attention_bias = config.bool_field("attention_bias", default=False)
        mlp_bias = config.bool_field("mlp_bias", default=False) if kind == "llama" else False
        return DecoderSpec(tuple(
            LayerSpec(
                GQA(
                    qkv_bias=True if kind == "qwen2" else attention_bias,
                    o_bias=False if kind == "qwen2" else attention_bias,
                    qk_norm="head" if kind == "qwen3" else None,
                    sliding_window=w,
                ),
                DenseMLP(bias=mlp_bias),
            )
            for w in _windows(config)
        ))
