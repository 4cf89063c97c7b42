"""Gemma 3 (text): GQA with (1 + w) per-head q/k norms, ``query_pre_attn_scalar ** -0.5`` softmax
scale, sliding layers interleaved with full ones (``layer_types``), each kind with its own RoPE
(``rope_parameters`` per layer type: local theta on sliding layers, linearly scaled global), a
gelu-tanh MLP, the sandwich residual (each sublayer's output normalised before the add), (1 + w)
norms in float32, embeddings times sqrt(hidden_size) rounded to the weight dtype, an optional final
logit soft-cap, a tied LM head. ``attn_logit_softcapping`` is never passed to attention by HF's
Gemma3, so it is not applied here either.
"""

from __future__ import annotations

from jaxinfer.config import ModelConfig
from jaxinfer.models.decoder import (DecoderForCausalLM, DecoderSpec, DenseMLP, LayerSpec, NormStyle,
                                     attention_layer_types, layer_windows)
from jaxinfer.models.layers.activations import get_activation
from jaxinfer.models.layers.attention import GQA
from jaxinfer.models.residual import SandwichResidual


class Gemma3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config: ModelConfig) -> DecoderSpec:
        activation = config.get("hidden_activation", "gelu_pytorch_tanh")
        get_activation(activation)
        scale = config.float_field("query_pre_attn_scalar", default=float(config.head_dim), gt=0) ** -0.5
        bias = config.bool_field("attention_bias", default=False)
        windows = layer_windows(config)
        layer_types = attention_layer_types(config)
        layers = tuple(
            LayerSpec(GQA(qkv_bias=bias, o_bias=bias, qk_norm="head", qk_norm_unit_offset=True, sliding_window=w,
                          scale=scale, rope_layer_type=kind),
                      DenseMLP(activation=activation), SandwichResidual())
            for w, kind in zip(windows, layer_types)
        )
        cap = config.float_field("final_logit_softcapping", default=None, gt=0)
        return DecoderSpec(layers, norm=NormStyle(unit_offset=True), embed_scale=True, final_logit_softcap=cap)
