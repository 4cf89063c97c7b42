"""Muse Glimmer (text model of ``MuseGlimmerForConditionalGeneration``, ``muse_glimmer_text``): a dense
Gemma-like decoder. GQA with weightless per-head q/k RMSNorms, q then times ``qk_scale_factor`` (the
softmax scale stays ``head_dim ** -0.5``), an elementwise sigmoid output gate from its own
``gate_proj``; sliding-window layers from ``layer_types`` and NoPE layers where ``layer_rope_theta``
is 0 (HF's defaults: every 4th layer counted back from the last is a full NoPE layer, the others
sliding with RoPE); a gated MLP (``hidden_activation``); the sandwich residual with (1 + w) norms,
the post-sublayer ones at ``post_norm_eps``; embeddings through a weightless RMSNorm; a plain-weight
final norm multiplied in float32; logits times ``output_multiplier``, then the tanh soft-cap.

HF's rotary embedding is built from the global ``rope_parameters`` alone: a non-zero per-layer theta
only marks a RoPE layer. A theta other than 0 or the global one is refused, as its meaning is
ambiguous (HF's config documents it as an override that its model never applies); so is a partial
rotary factor, which HF's attention cannot apply.

As HF's wrapper does: the LM head is tied only by the wrapper config's ``tie_word_embeddings`` (its
text config's flag is not read), and the image and video placeholder ids are embedded as token 0. The
vision tower, its adapter and projection are skipped (text input only).
"""

from __future__ import annotations

from jaxinfer import checks
from jaxinfer.config import ModelConfig
from jaxinfer.errors import ConfigError
from jaxinfer.models.decoder import DecoderForCausalLM, DecoderSpec, DenseMLP, LayerSpec, NormStyle, layer_windows
from jaxinfer.models.layers.activations import get_activation
from jaxinfer.models.layers.attention import GQA
from jaxinfer.models.residual import SandwichResidual


def rope_layers(config: ModelConfig) -> tuple[bool, ...]:
    """Per layer, whether it applies RoPE: ``layer_rope_theta`` non-zero (0 marks a NoPE layer)."""
    n, thetas = config.num_hidden_layers, config.get("layer_rope_theta")
    if not isinstance(thetas, (list, tuple)) or len(thetas) != n:
        raise ConfigError(f"layer_rope_theta must list a RoPE theta (0 for NoPE) for each of the {n} layers, "
                          f"got {thetas!r}")
    rope_theta = config.rope.theta
    if config.rope.partial_rotary_factor != 1:
        raise ConfigError(f"partial_rotary_factor is {config.rope.partial_rotary_factor}: Muse Glimmer's RoPE layers "
                          "rotate the whole head (HF's model has no partial rotary)")
    for i, theta in enumerate(thetas):
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta not in (0, rope_theta):
            raise ConfigError(f"layer_rope_theta[{i}] is {theta!r}: each entry must be 0 (NoPE) or the model's "
                              f"rope_theta ({rope_theta}), the only RoPE HF's Muse Glimmer applies")
    return tuple(theta != 0 for theta in thetas)


class MuseGlimmerForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config: ModelConfig) -> DecoderSpec:
        activation = config.get("hidden_activation", "silu")
        get_activation(activation)
        bias = config.bool_field("attention_bias", default=False)
        query_multiplier = config.float_field("qk_scale_factor", gt=0)
        post_eps = config.float_field("post_norm_eps", gt=0)
        norm_eps = (("post_attention_layernorm", post_eps), ("post_feedforward_layernorm", post_eps))
        layers = tuple(
            LayerSpec(GQA(qkv_bias=bias, o_bias=bias, qk_norm="head", qk_norm_weight=False,
                          query_multiplier=query_multiplier, gate_proj=True, sliding_window=window, use_rope=rope),
                      DenseMLP(activation=activation), SandwichResidual(), norm_eps=norm_eps)
            for window, rope in zip(layer_windows(config), rope_layers(config))
        )
        placeholders = tuple(checks.integer(getattr(config.hf, key), key, ge=0)
                             for key in ("image_token_id", "video_token_id")
                             if getattr(config.hf, key, None) is not None)
        return DecoderSpec(layers, norm=NormStyle(unit_offset=True), embed_norm=True, placeholder_ids=placeholders,
                           final_norm=NormStyle(float32_weight=True),
                           logit_multiplier=config.float_field("output_multiplier", gt=0),
                           final_logit_softcap=config.float_field("final_logit_softcapping", gt=0))

    @classmethod
    def ties_lm_head(cls, config: ModelConfig) -> bool:
        # HF's wrapper ties by its own config's flag (absent: untied), not by its text config's.
        return checks.boolean(getattr(config.hf, "tie_word_embeddings", False), "tie_word_embeddings")

    @classmethod
    def skipped_checkpoint_keys_for(cls, config: ModelConfig) -> tuple[tuple[str, str], ...]:
        return ((r"^model\.(vision_tower|vision_adapter|vision_projection)\.",
                 "the vision tower, adapter and projection (text input only)"),)
