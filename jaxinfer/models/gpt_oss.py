"""GPT-OSS: attention with sinks and biases, alternating sliding-window / full layers, YaRN RoPE,
and biased top-k-then-softmax routing over experts with a clamped SwiGLU.

On disk the experts are fused, in ``x @ W`` orientation: ``gate_up_proj`` ``[E, H, 2I]`` with gate
and up **interleaved** (even / odd columns) and ``down_proj`` ``[E, I, H]``, each with a bias; or
MXFP4-quantised as ``*_blocks`` (uint8, two FP4 values per byte) and ``*_scales`` (uint8 exponents,
bias 127), one scale per 32 values, stored ``[E, 2I, H]`` / ``[E, H, I]``. Both are re-laid out on
load into the stacked nn.Linear layout every MoE model here uses. MXFP4 experts stay packed on the
device (``jaxinfer.quantization.Mxfp4Weight``) with ``quantization="auto"`` where each device's piece
is whole groups of 32; else (and with ``quantization=None``) they are dequantised to the serving dtype.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.models.decoder import DecoderForCausalLM, DecoderSpec, LayerSpec, NormStyle, layer_windows
from jaxinfer.models.layers.attention import GQA
from jaxinfer.models.layers.moe import MoESpec
from jaxinfer.quantization import Mxfp4Tensor
from jaxinfer.weights import Derived, Tensor


def _expert_sources(prefix: str, available: set[str]) -> dict[str, object]:
    """Sources of one layer's expert parameters (``prefix`` = ``model.layers.N.mlp.experts``)."""
    gate_up, down = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
    sources = {
        "gate_proj_bias": Derived([f"{gate_up}_bias"], lambda b: b[:, 0::2], lambda s: (s[0], s[1] // 2)),
        "up_proj_bias": Derived([f"{gate_up}_bias"], lambda b: b[:, 1::2], lambda s: (s[0], s[1] // 2)),
        "down_proj_bias": Tensor(f"{down}_bias"),
    }
    if f"{gate_up}_blocks" in available:  # MXFP4: rows are output features already ([E, 2I, H], [E, H, I])
        gate_up_parts = (f"{gate_up}_blocks", f"{gate_up}_scales")
        sources["gate_proj"] = Mxfp4Tensor(*gate_up_parts, rows=slice(0, None, 2))
        sources["up_proj"] = Mxfp4Tensor(*gate_up_parts, rows=slice(1, None, 2))
        sources["down_proj"] = Mxfp4Tensor(f"{down}_blocks", f"{down}_scales")
    else:  # [E, H, 2I] and [E, I, H], used as x @ W
        swap = lambda s: (s[0], s[2] // 2, s[1])  # noqa: E731
        sources["gate_proj"] = Derived([gate_up], lambda w: w[:, :, 0::2].transpose(0, 2, 1), swap)
        sources["up_proj"] = Derived([gate_up], lambda w: w[:, :, 1::2].transpose(0, 2, 1), swap)
        sources["down_proj"] = Derived([down], lambda w: w.transpose(0, 2, 1), lambda s: (s[0], s[2], s[1]))
    return sources


class GptOssForCausalLM(DecoderForCausalLM):
    supports_expert_parallel = True

    @classmethod
    def spec(cls, config: ModelConfig) -> DecoderSpec:
        bias = config.bool_field("attention_bias", default=True)
        num_experts = config.int_field("num_local_experts", "num_experts", ge=1)
        moe = MoESpec(num_experts=num_experts, top_k=config.int_field("num_experts_per_tok", ge=1, le=num_experts),
                      intermediate_size=config.int_field("intermediate_size", ge=1), router="topk_softmax",
                      router_name="router", router_bias=True, expert_bias=True, activation="gpt_oss",
                      alpha=config.float_field("swiglu_alpha", default=1.702),
                      limit=config.float_field("swiglu_limit", default=7.0, gt=0))
        return DecoderSpec(
            tuple(LayerSpec(GQA(qkv_bias=bias, o_bias=bias, sinks=True, sliding_window=w), moe)
                  for w in layer_windows(config)),
            norm=NormStyle(float32_weight=True),
        )

    @classmethod
    def checkpoint_sources(cls, config: ModelConfig, expected: dict, available: set[str]) -> dict:
        sources, per_layer = {}, {}
        for path in expected:
            if len(path) >= 2 and path[-2] == "experts":
                prefix = cls.path_to_checkpoint_name(path[:-1])
                if prefix not in per_layer:
                    per_layer[prefix] = _expert_sources(prefix, available)
                sources[path] = per_layer[prefix][path[-1]]
            else:
                sources[path] = Tensor(cls.path_to_checkpoint_name(path))
        return sources

    @classmethod
    def checkpoint_tensors(cls, config: ModelConfig, params: dict) -> dict:
        """Experts fused as on disk (bf16 layout): ``gate_up_proj`` [E, H, 2I] with gate and up
        interleaved, ``down_proj`` [E, I, H], and their biases."""
        experts = {path: value for path, value in params.items() if len(path) >= 2 and path[-2] == "experts"}
        tensors = super().checkpoint_tensors(config, {p: v for p, v in params.items() if p not in experts})
        for prefix in {path[:-1] for path in experts}:
            name = cls.path_to_checkpoint_name(prefix)
            part = {key: experts[(*prefix, key)] for key in ("gate_proj", "up_proj", "down_proj", "gate_proj_bias",
                                                              "up_proj_bias", "down_proj_bias")}
            gate_up = np.stack([part["gate_proj"], part["up_proj"]], axis=-2)  # [E, I, 2, H]
            tensors[f"{name}.gate_up_proj"] = gate_up.reshape(gate_up.shape[0], -1, gate_up.shape[-1]).transpose(0, 2, 1)
            tensors[f"{name}.gate_up_proj_bias"] = np.stack([part["gate_proj_bias"], part["up_proj_bias"]],
                                                            axis=-1).reshape(gate_up.shape[0], -1)
            tensors[f"{name}.down_proj"] = part["down_proj"].transpose(0, 2, 1)
            tensors[f"{name}.down_proj_bias"] = part["down_proj_bias"]
        return tensors
