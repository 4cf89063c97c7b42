"""The Qwen gated-DeltaNet hybrids: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (their text models).

``layer_types`` says which layers are gated DeltaNet ("linear_attention",
``jaxinfer.models.layers.gated_deltanet``) and which are gated full attention ("full_attention": GQA
whose ``q_proj`` gives ``[q | gate]`` per head, a sigmoid output gate, (1 + w) per-head q/k norms and
partial RoPE; Qwen3.5's interleaved M-RoPE is that RoPE for text, whose three position rows are
equal). Every RMSNorm of the decoder is (1 + w). MoE layers route softmax top-k and add a shared
expert gated by ``sigmoid(shared_expert_gate(x))``.

The families differ in the DeltaNet's projection layout (Qwen3-Next groups them per key head,
Qwen3.5 keeps them flat) and in which layers are sparse: Qwen3-Next as Qwen3-MoE
(``decoder_sparse_step``, ``mlp_only_layers``), Qwen3.5 none, Qwen3.5-MoE all (always renormalised).
Checkpoints of the multimodal wrappers (``model.language_model.*``) load too; their vision towers are
skipped. The DeltaNet's conv weight and Qwen3.5's ``in_proj_qkv`` are re-laid out on load into the
channel order grouped per key head that tensor parallelism splits (``gated_deltanet``).
"""

from __future__ import annotations

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.models.decoder import DecoderForCausalLM, DecoderSpec, DenseMLP, LayerSpec, NormStyle
from jaxinfer.models.layers.attention import GQA
from jaxinfer.models.layers.gated_deltanet import GatedDeltaNet
from jaxinfer.models.layers.moe import MoESpec
from jaxinfer.models.moe_checkpoints import check_expert_count, per_expert_sources
from jaxinfer.weights import FLOAT_DTYPES, Derived

LAYER_TYPES = ("linear_attention", "full_attention")


class RowsInOrder:
    """A parameter whose rows are a checkpoint tensor's rows in another order (``rows[i]``: the
    stored row of parameter row ``i``). A device reads only the rows of its slice, in as many
    contiguous runs as they make in the stored order."""

    dtypes = FLOAT_DTYPES

    def __init__(self, name: str, rows: np.ndarray):
        self.names, self.rows = (name,), rows

    def shape(self, checkpoint) -> tuple[int, ...]:
        return checkpoint.shape(self.names[0])

    def read(self, checkpoint, index) -> np.ndarray:
        index = tuple(index) if index is not None else ()
        index += (slice(None),) * (len(self.shape(checkpoint)) - len(index))
        wanted = self.rows[index[0]]
        stored = np.unique(wanted)
        runs = np.split(stored, np.flatnonzero(np.diff(stored) != 1) + 1)
        block = np.concatenate([checkpoint.read(self.names[0], (slice(int(run[0]), int(run[-1]) + 1), *index[1:]))
                                for run in runs])
        return block[np.searchsorted(stored, wanted)]


def _grouped_conv_source(name: str, order: np.ndarray, num_key_heads: int) -> Derived:
    """The conv weight ``[C, 1, K]`` (channels ``[Q_all | K_all | V_all]``) as ``[Hk, C / Hk, K]``,
    its channels grouped per key head (``order``: ``grouped_channels``)."""
    def shape(stored):  # the stored shape where it is not the one expected, so the check names it
        fits = len(stored) == 3 and tuple(stored[:2]) == (len(order), 1)
        return (num_key_heads, stored[0] // num_key_heads, stored[2]) if fits else stored
    return Derived([name], lambda w: w[order, 0, :].reshape(num_key_heads, -1, w.shape[2]), shape)


def hybrid_layer_types(config: ModelConfig) -> tuple[str, ...]:
    """``layer_types`` checked: one "linear_attention" or "full_attention" per layer (HF's config
    classes derive it from ``full_attention_interval`` when a checkpoint does not list it)."""
    return config.layer_kinds("layer_types", LAYER_TYPES)


class Qwen3NextForCausalLM(DecoderForCausalLM):
    """Qwen3-Next; Qwen3.5 and Qwen3.5-MoE below change the projection layout and the sparse layers."""

    supports_expert_parallel = True
    deltanet_layout = "grouped"

    @classmethod
    def sparse_layers(cls, config: ModelConfig, num_experts: int) -> tuple[bool, ...]:
        n = config.num_hidden_layers
        dense_only = set(config.int_list_field("mlp_only_layers", ge=0, le=n - 1))
        step = config.int_field("decoder_sparse_step", default=1, ge=1)
        return tuple(num_experts > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(n))

    @classmethod
    def norm_topk_prob(cls, config: ModelConfig) -> bool:
        return config.bool_field("norm_topk_prob", default=True)

    @classmethod
    def num_experts(cls, config: ModelConfig) -> int:
        return config.int_field("num_experts", default=0, ge=0)

    @classmethod
    def spec(cls, config: ModelConfig) -> DecoderSpec:
        bias = config.bool_field("attention_bias", default=False)
        attention = GQA(qkv_bias=bias, o_bias=bias, qk_norm="head", qk_norm_unit_offset=True, output_gate=True)
        deltanet = GatedDeltaNet(cls.deltanet_layout)
        num_experts = cls.num_experts(config)
        moe = None
        if num_experts:
            moe = MoESpec(num_experts=num_experts, top_k=config.int_field("num_experts_per_tok", ge=1, le=num_experts),
                          intermediate_size=config.int_field("moe_intermediate_size", ge=1), router="softmax_topk",
                          norm_topk_prob=cls.norm_topk_prob(config),
                          shared_intermediate_size=config.int_field("shared_expert_intermediate_size", ge=1),
                          shared_expert_gated=True)
        layers = tuple(
            LayerSpec(deltanet if kind == "linear_attention" else attention, moe if sparse else DenseMLP())
            for kind, sparse in zip(hybrid_layer_types(config), cls.sparse_layers(config, num_experts)))
        return DecoderSpec(layers, norm=NormStyle(unit_offset=True))

    @classmethod
    def skipped_checkpoint_keys_for(cls, config: ModelConfig) -> tuple[tuple[str, str], ...]:
        return super().skipped_checkpoint_keys_for(config) + ((r"^mtp\.", "multi-token-prediction layers"),)

    @classmethod
    def check_checkpoint_layout(cls, config: ModelConfig, checkpoint) -> None:
        super().check_checkpoint_layout(config, checkpoint)
        if cls.num_experts(config):
            skipped = tuple(pattern for pattern, _ in cls.skipped_checkpoint_keys_for(config))
            check_expert_count(checkpoint, "num_experts", cls.num_experts(config), skipped)

    @classmethod
    def _relaid_out(cls, path: tuple[str, ...]) -> bool:
        """Whether the parameter at ``path`` is re-laid out on load: a DeltaNet's conv weight, or its
        flat ``in_proj_qkv``."""
        return len(path) >= 3 and path[-3] == "linear_attn" and path[-2] in ("conv1d", "in_proj_qkv")

    @classmethod
    def checkpoint_sources(cls, config: ModelConfig, expected: dict, available: set[str]) -> dict:
        sources = per_expert_sources(cls, expected, {"gate_proj": "gate_proj", "up_proj": "up_proj",
                                                     "down_proj": "down_proj"})
        relaid = [path for path in expected if cls._relaid_out(path)]
        if relaid:
            deltanet = GatedDeltaNet(cls.deltanet_layout)
            order, num_key_heads = deltanet.channel_order(config), deltanet.sizes(config)["num_key_heads"]
            for path in relaid:
                name = cls.path_to_checkpoint_name(path)
                sources[path] = (_grouped_conv_source(name, order, num_key_heads) if path[-2] == "conv1d"
                                 else RowsInOrder(name, order))
        return sources

    @classmethod
    def checkpoint_tensors(cls, config: ModelConfig, params: dict) -> dict:
        """The re-laid-out parameters back in the checkpoint's channel order ``[Q_all | K_all |
        V_all]``; the others as ``checkpoint_sources`` names them."""
        relaid = {path: value for path, value in params.items() if cls._relaid_out(path)}
        tensors = super().checkpoint_tensors(config, {p: v for p, v in params.items() if p not in relaid})
        if relaid:
            stored_order = np.argsort(GatedDeltaNet(cls.deltanet_layout).channel_order(config))
            for path, value in relaid.items():
                if path[-2] == "conv1d":  # [Hk, C / Hk, K] -> [C, 1, K]
                    value = value.reshape(-1, value.shape[-1])[:, None, :]
                tensors[cls.path_to_checkpoint_name(path)] = value[stored_order]
        return tensors


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 (dense): flat DeltaNet projections, a dense MLP in every layer."""

    supports_expert_parallel = False
    deltanet_layout = "flat"

    @classmethod
    def num_experts(cls, config: ModelConfig) -> int:
        return 0


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5-MoE: flat DeltaNet projections, every layer sparse, top-k always renormalised."""

    deltanet_layout = "flat"

    @classmethod
    def sparse_layers(cls, config: ModelConfig, num_experts: int) -> tuple[bool, ...]:
        return (True,) * config.num_hidden_layers

    @classmethod
    def num_experts(cls, config: ModelConfig) -> int:
        return config.int_field("num_experts", ge=1)

    @classmethod
    def norm_topk_prob(cls, config: ModelConfig) -> bool:
        return True
