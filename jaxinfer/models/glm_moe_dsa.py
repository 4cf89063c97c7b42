"""GLM-5 (``GlmMoeDsaForCausalLM``): DeepSeek-V3.2 with two differences.

- The indexer rotates its first ``qk_rope_head_dim`` dims as interleaved pairs (DeepSeek-V3.2:
  ``rotate_half``).
- ``indexer_types``: a "full" layer runs its indexer; a "shared" layer has none and attends to the
  selection of the last full layer before it (HF's ``prev_topk_indices``), so it keeps no indexer
  keys either. HF's config class fills the list in from ``index_topk_freq`` /
  ``index_skip_topk_offset`` (or ``index_topk_pattern``).
"""

from __future__ import annotations

import dataclasses

from jaxinfer.config import ModelConfig
from jaxinfer.errors import ConfigError
from jaxinfer.models.decoder import DecoderSpec, DenseMLP, LayerSpec, mlp_layer_types
from jaxinfer.models.deepseek_v3 import deepseek_moe, mla_spec
from jaxinfer.models.deepseek_v32 import DeepseekV32ForCausalLM, indexer_spec


def indexer_types(config: ModelConfig) -> tuple[str, ...]:
    """``indexer_types`` ("full" / "shared" per layer, the first one full), as HF's config fills it in."""
    kinds = config.layer_kinds("indexer_types", ("full", "shared"))
    if kinds[0] != "full":
        raise ConfigError("indexer_types[0] is 'shared', but a shared layer reuses the selection of a full layer "
                          "before it: the first layer must be 'full'")
    return kinds


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    @classmethod
    def spec(cls, config: ModelConfig) -> DecoderSpec:
        mla = dataclasses.replace(mla_spec(config), rope_interleave=True)  # always interleaved in HF's GLM-5
        full = dataclasses.replace(mla, indexer=indexer_spec(config, rope_interleave=True))
        shared = dataclasses.replace(mla, shares_selection=True)
        moe = deepseek_moe(config)
        return DecoderSpec(tuple(
            LayerSpec(full if kind == "full" else shared, moe if mlp == "sparse" else DenseMLP())
            for kind, mlp in zip(indexer_types(config), mlp_layer_types(config))))
