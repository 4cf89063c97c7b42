"""HF architecture name -> model implementation, imported only when asked for.

Entries are fully-qualified ``"package.module:Class"`` strings, so an external package can plug its
own model in without touching jaxinfer::

    from jaxinfer import ModelRegistry
    ModelRegistry.register("FooForCausalLM", "my_pkg.models.foo:FooForCausalLM")
"""

from __future__ import annotations

import importlib

from jaxinfer.errors import UnsupportedArchitectureError

_DENSE = "jaxinfer.models.dense:DenseDecoderForCausalLM"
_DEEPSEEK_V3 = "jaxinfer.models.deepseek_v3:DeepseekV3ForCausalLM"
_QWEN3_5 = "jaxinfer.models.qwen3_next:Qwen3_5ForCausalLM"
_QWEN3_5_MOE = "jaxinfer.models.qwen3_next:Qwen3_5MoeForCausalLM"
_BUILTIN_MODELS: dict[str, str] = {
    "LlamaForCausalLM": _DENSE,
    "MistralForCausalLM": _DENSE,
    "Qwen2ForCausalLM": _DENSE,
    "Qwen3ForCausalLM": _DENSE,
    "Qwen3MoeForCausalLM": "jaxinfer.models.qwen3_moe:Qwen3MoeForCausalLM",
    "MiniMaxM2ForCausalLM": "jaxinfer.models.minimax_m2:MiniMaxM2ForCausalLM",
    "MiniMaxForCausalLM": "jaxinfer.models.minimax:MiniMaxForCausalLM",
    "GptOssForCausalLM": "jaxinfer.models.gpt_oss:GptOssForCausalLM",
    "Gemma3ForCausalLM": "jaxinfer.models.gemma3:Gemma3ForCausalLM",
    # Its text model (text_config); HF has no text-only class with an LM head.
    "MuseGlimmerForConditionalGeneration": "jaxinfer.models.muse_glimmer:MuseGlimmerForCausalLM",
    "DeepseekV3ForCausalLM": _DEEPSEEK_V3,
    "SarvamMLAForCausalLM": _DEEPSEEK_V3,  # model_type sarvam_mla: DeepSeek-V3 underneath
    "Kimi_K25ForConditionalGeneration": _DEEPSEEK_V3,  # its text model (text_config) is DeepSeek-V3
    "DeepseekV32ForCausalLM": "jaxinfer.models.deepseek_v32:DeepseekV32ForCausalLM",
    "GlmMoeDsaForCausalLM": "jaxinfer.models.glm_moe_dsa:GlmMoeDsaForCausalLM",
    "HYV4ForCausalLM": "jaxinfer.models.hy_v4:HYV4ForCausalLM",
    "KimiLinearForCausalLM": "jaxinfer.models.kimi_linear:KimiLinearForCausalLM",
    "BailingHybridForCausalLM": "jaxinfer.models.bailing_hybrid:BailingHybridForCausalLM",
    "Qwen3NextForCausalLM": "jaxinfer.models.qwen3_next:Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM": _QWEN3_5,
    "Qwen3_5ForConditionalGeneration": _QWEN3_5,  # its text model (text_config)
    "Qwen3_5MoeForCausalLM": _QWEN3_5_MOE,
    "Qwen3_5MoeForConditionalGeneration": _QWEN3_5_MOE,
}


class _ModelRegistry:
    def __init__(self, entries: dict[str, str]):
        self._entries = dict(entries)
        self._loaded: dict[str, type] = {}

    def register(self, architecture: str, target: str | type) -> None:
        """Register an architecture; ``target`` is a class or a ``"package.module:Class"`` string."""
        if isinstance(target, str) and ":" not in target:
            raise ValueError(f"registry target must look like 'package.module:Class', got {target!r}")
        self._loaded.pop(architecture, None)
        if isinstance(target, type):
            self._loaded[architecture] = target
            self._entries[architecture] = f"{target.__module__}:{target.__qualname__}"
        else:
            self._entries[architecture] = target

    def supported_architectures(self) -> list[str]:
        return sorted(self._entries)

    def resolve(self, architecture: str) -> type:
        if architecture in self._loaded:
            return self._loaded[architecture]
        target = self._entries.get(architecture)
        if target is None:
            raise UnsupportedArchitectureError(
                f"architecture {architecture!r} is not supported. Supported: "
                f"{', '.join(self.supported_architectures())}. External packages can add one with "
                "jaxinfer.ModelRegistry.register(name, 'pkg.module:Class')."
            )
        module_name, class_name = target.split(":")
        cls = getattr(importlib.import_module(module_name), class_name)
        self._loaded[architecture] = cls
        return cls


ModelRegistry = _ModelRegistry(_BUILTIN_MODELS)
