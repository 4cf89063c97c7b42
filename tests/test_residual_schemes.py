"""Residual schemes beyond the families' parity tests: HY-V4's independent hyper-connections (iHC)
against transformers' own modules, composed as its decoder layer composes them, and the decoder's
check that every layer hands on one kind of stream."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxinfer.models.decoder import DecoderLayer, DecoderSpec, DenseMLP, LayerSpec, NormStyle
from jaxinfer.models.layers.linear import Linear
from jaxinfer.models.layers.norm import RMSNorm
from jaxinfer.models.residual import IndependentHyperConnections, PreNormResidual, SandwichResidual

HIDDEN, INTERMEDIATE, STREAMS, LAYERS, TOKENS, EPS = 16, 24, 4, 2, 5, 1e-6


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """The config fields a decoder layer reads."""

    hidden_size: int = HIDDEN
    intermediate_size: int = INTERMEDIATE
    rms_norm_eps: float = EPS
    hidden_act: str = "silu"


class LinearMixer(nn.Module):
    """A mixer with no cache: one projection of its input."""

    @nn.compact
    def __call__(self, x, cache, md, rotary):
        return Linear(x.shape[-1], name="o_proj")(x.normed()), cache


@dataclasses.dataclass(frozen=True)
class LinearMixerSpec:
    name: str = "self_attn"

    def module(self, config, param_dtype):
        return LinearMixer(name=self.name)


class Layers(nn.Module):
    """``LAYERS`` decoder layers of the scheme, then its finish with the final norm."""

    config: LayerConfig
    scheme: object

    @nn.compact
    def __call__(self, x):
        stream = self.scheme.start(x)
        spec = LayerSpec(LinearMixerSpec(), DenseMLP(), self.scheme)
        for i in range(LAYERS):
            stream, _ = DecoderLayer(self.config, spec, NormStyle(), jnp.float32, name=f"layers_{i}")(
                stream, {}, None, None)
        return self.scheme.finish(stream, RMSNorm(EPS, name="norm"))


def _hf_ihc_stack(seed: int):
    """HF's HY-V4 modules with random parameters (norms and gates noised), and their forward as
    ``HYV4DecoderLayer`` / ``HYV4Model`` compose them around a linear mixer and a dense MLP."""
    from transformers.models.hy_v4 import modeling_hy_v4 as hf

    config = hf.HYV4Config(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, hc_mult=STREAMS, rms_norm_eps=EPS,
                           hidden_act="silu")
    torch.manual_seed(seed)
    layers = torch.nn.ModuleList()
    for _ in range(LAYERS):
        layer = torch.nn.Module()
        layer.self_attn = torch.nn.Module()
        layer.self_attn.o_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        layer.mlp = hf.HYV4MLP(config)
        layer.input_layernorm = hf.HYV4RMSNorm(HIDDEN, EPS)
        layer.post_attention_layernorm = hf.HYV4RMSNorm(HIDDEN, EPS)
        layer.attn_hc, layer.ffn_hc = hf.HYV4HyperConnection(config), hf.HYV4HyperConnection(config)
        layers.append(layer)
    model = torch.nn.Module()
    model.layers, model.norm, model.hc_head = layers, hf.HYV4RMSNorm(HIDDEN, EPS), hf.HYV4HyperHead(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if "scale" in name or "base" in name else 0.1)
                    + (1.0 if "norm" in name else 0.0))

    def forward(x):  # x [T, H]; HF's streams are [batch, T, n, H]
        streams = x[None, :, None, :].expand(1, -1, STREAMS, -1)
        for layer in layers:
            for hc, norm, run in ((layer.attn_hc, layer.input_layernorm, layer.self_attn.o_proj),
                                  (layer.ffn_hc, layer.post_attention_layernorm, layer.mlp)):
                post, read = hc(streams)
                out = run(norm(read))
                streams = post.unsqueeze(-1) * out.unsqueeze(-2) + streams
        return model.norm(model.hc_head(streams))[0]

    return model, forward


def _flax_params(model) -> dict:
    """HF's parameter names as the flax tree (``nn.Linear`` weights keep their [out, in] layout)."""
    params = {}
    for name, p in model.named_parameters():
        node = params
        *path, leaf = name.replace("layers.", "layers_").split(".")
        for key in path:
            node = node.setdefault(key, {})
        node[leaf] = jnp.asarray(p.detach().numpy())
    return {"params": params}


def test_independent_hyper_connections_match_hf():
    model, forward = _hf_ihc_stack(seed=0)
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        want = forward(x).numpy()
    layers = Layers(LayerConfig(), IndependentHyperConnections(STREAMS, EPS))
    got = layers.apply(_flax_params(model), jnp.asarray(x.numpy()))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    # The streams as a hidden state are the n streams themselves.
    assert IndependentHyperConnections(STREAMS, EPS).start(jnp.ones((TOKENS, HIDDEN))).shape == (TOKENS, STREAMS,
                                                                                                 HIDDEN)


def test_a_decoder_hands_on_one_kind_of_stream():
    mixer = LinearMixerSpec()
    DecoderSpec((LayerSpec(mixer), LayerSpec(mixer)))
    with pytest.raises(ValueError, match="one kind"):
        DecoderSpec((LayerSpec(mixer, residual=PreNormResidual()), LayerSpec(mixer, residual=SandwichResidual())))
