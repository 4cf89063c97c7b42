"""How a decoder's residual stream runs through its layers: a scheme, with behaviour.

A scheme says how the stream starts from the embeddings (``start``), what a layer's mixer and
feed-forward read and how their outputs are written back (``layer``), the stream as one hidden state
(``hidden``: what a research forward records after each layer) and how the final hidden state is
formed (``finish``). The decoder loop only hands the stream from layer to layer; mixers and
feed-forwards read a ``SublayerInput`` and return their output, never the stream.

* ``PreNormResidual``: HF's pre-norm block, ``h = x + mixer(norm(x))``, ``out = h + ffn(norm(h))``.
  Each add is left for the norm after it (``PreNormed``), so add, norm and the projections after it
  are one op.
* ``SandwichResidual``: Gemma's; each sublayer's output is normalised again before the add.
* ``ScaledNormedResidual``: MiniMax-Text-01's; the normed stream is the residual, both branches scaled.

A scheme with several streams (hyper-connections) keeps them in a stream value of its own: ``start``
expands the embeddings into them, ``layer`` reads the sublayers' inputs from them and writes their
outputs back, ``finish`` collapses them. All layers of a decoder use schemes of one kind, since the
stream passes from each to the next.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.models.layers.norm import PreNormed, Rows, SublayerInput


@dataclasses.dataclass(frozen=True)
class Stream:
    """One residual stream, as a pre-norm layer hands it on: the last sublayer's output ``x`` and the
    stream before it, ``residual``, not yet added (None once they are one array)."""

    x: jax.Array
    residual: jax.Array | None = None

    def summed(self) -> jax.Array:
        return self.x if self.residual is None else self.x + self.residual


class LayerParts:
    """What a scheme composes in one layer (``jaxinfer.models.decoder.DecoderLayer`` makes it): the
    layer's RMSNorms by checkpoint name, its mixer and its feed-forward."""

    def rms_norm(self, name: str, x) -> jax.Array:
        """``x`` through the layer's RMSNorm ``name``."""
        raise NotImplementedError

    def pre_normed(self, name: str, x, residual) -> PreNormed:
        """``x + residual`` through the RMSNorm ``name``, left for the sublayer's first projections."""
        raise NotImplementedError

    def mix(self, x: SublayerInput) -> jax.Array:
        raise NotImplementedError

    def feed_forward(self, x: SublayerInput) -> jax.Array:
        raise NotImplementedError


class OneStream:
    """The schemes with one stream (``Stream``): how it starts, reads as a hidden state and ends."""

    def start(self, embeddings) -> Stream:
        return Stream(embeddings)

    def hidden(self, stream: Stream) -> jax.Array:
        return stream.summed()

    def finish(self, stream: Stream, final_norm) -> jax.Array:
        """The final hidden state: ``final_norm`` (an ``RMSNorm`` module) of the stream, the last add
        folded into it."""
        return final_norm(stream.x) if stream.residual is None else final_norm(stream.x, stream.residual)[0]


@dataclasses.dataclass(frozen=True)
class PreNormResidual(OneStream):
    """HF's pre-norm block: ``h = x + mixer(norm(x))``, ``out = h + ffn(norm(h))``; norms
    ``input_layernorm`` and ``post_attention_layernorm``. The stream leaves the layer unsummed, so the
    next add runs in one op with the norm and projections after it."""

    def layer(self, parts: LayerParts, stream: Stream) -> Stream:
        mixer_input = parts.pre_normed("input_layernorm", stream.x, stream.residual)
        mixer_out = parts.mix(mixer_input)
        ffn_input = parts.pre_normed("post_attention_layernorm", mixer_out, mixer_input.summed)
        return Stream(parts.feed_forward(ffn_input), ffn_input.summed)


@dataclasses.dataclass(frozen=True)
class SandwichResidual(OneStream):
    """Gemma's: each sublayer's output is normalised again before the add,
    ``h = x + post_attention_layernorm(mixer(input_layernorm(x)))``,
    ``out = h + post_feedforward_layernorm(ffn(pre_feedforward_layernorm(h)))``."""

    def layer(self, parts: LayerParts, stream: Stream) -> Stream:
        x = stream.summed()
        h = x + parts.rms_norm("post_attention_layernorm", parts.mix(Rows(parts.rms_norm("input_layernorm", x))))
        ffn_out = parts.feed_forward(Rows(parts.rms_norm("pre_feedforward_layernorm", h)))
        return Stream(h + parts.rms_norm("post_feedforward_layernorm", ffn_out))


@dataclasses.dataclass(frozen=True)
class ScaledNormedResidual(OneStream):
    """MiniMax-Text-01's: the residual is the *normed* stream and both branches are scaled,
    ``n = input_layernorm(x)``, ``h = mixer_alpha * n + mixer_beta * mixer(n)``,
    ``m = post_attention_layernorm(h)``, ``out = ffn_alpha * m + ffn_beta * ffn(m)``."""

    mixer_alpha: float
    mixer_beta: float
    ffn_alpha: float
    ffn_beta: float

    def layer(self, parts: LayerParts, stream: Stream) -> Stream:
        normed = parts.rms_norm("input_layernorm", stream.summed())
        mixer_out = parts.mix(Rows(normed))
        h = parts.rms_norm("post_attention_layernorm", normed * self.mixer_alpha + mixer_out * self.mixer_beta)
        return Stream(h * self.ffn_alpha + parts.feed_forward(Rows(h)) * self.ffn_beta)


class _HyperConnection(nn.Module):
    """One sublayer's independent hyper-connection (HY-V4's ``attn_hc`` / ``ffn_hc``), in float32:
    from the streams ``[T, n, H]``, ``mixes = (flat @ fn.T) * rsqrt(mean(flat^2) + eps)`` (``flat``:
    the n streams side by side), then the read gates ``pre = sigmoid(mixes[:n] * scale[0] + base[:n])
    + hc_eps`` and write gates ``post = magnitude * sigmoid(mixes[n:] * scale[1] + base[n:]) + hc_eps``.
    -> (post [T, n] float32, the sublayer's input ``sum_i pre_i * stream_i`` in the streams' dtype)."""

    streams: int
    norm_eps: float
    hc_eps: float
    magnitude: float

    @nn.compact
    def __call__(self, streams):
        n, width = self.streams, streams.shape[-1]
        fn = self.param("fn", nn.initializers.normal(0.02), (2 * n, n * width), jnp.float32)
        base = self.param("base", nn.initializers.zeros, (2 * n,), jnp.float32)
        scale = self.param("scale", nn.initializers.constant(0.01), (2,), jnp.float32)
        pre_logits, post_logits = jnp.split(_stream_mixes(streams, fn, self.norm_eps), 2, axis=-1)
        pre = jax.nn.sigmoid(pre_logits * scale[0] + base[:n]) + self.hc_eps
        post = self.magnitude * jax.nn.sigmoid(post_logits * scale[1] + base[n:]) + self.hc_eps
        read = jnp.sum(pre[..., None] * streams.astype(jnp.float32), axis=-2)
        return post, read.astype(streams.dtype)


class _HyperHead(nn.Module):
    """The collapse of the streams at the end (HY-V4's ``hc_head``): ``sum_i pre_i * stream_i`` with
    ``pre = sigmoid(mixes * hc_scale + hc_base) + hc_eps``, ``mixes`` as in ``_HyperConnection``."""

    streams: int
    norm_eps: float
    hc_eps: float

    @nn.compact
    def __call__(self, streams):
        n, width = self.streams, streams.shape[-1]
        fn = self.param("hc_fn", nn.initializers.normal(0.02), (n, n * width), jnp.float32)
        base = self.param("hc_base", nn.initializers.zeros, (n,), jnp.float32)
        scale = self.param("hc_scale", nn.initializers.constant(0.01), (1,), jnp.float32)
        pre = jax.nn.sigmoid(_stream_mixes(streams, fn, self.norm_eps) * scale + base) + self.hc_eps
        return jnp.sum(pre[..., None] * streams.astype(jnp.float32), axis=-2).astype(streams.dtype)


def _stream_mixes(streams, fn, eps: float):
    """``(flat @ fn.T) * rsqrt(mean(flat^2) + eps)`` in float32, ``flat`` the streams side by side."""
    flat = streams.reshape(*streams.shape[:-2], -1).astype(jnp.float32)
    inverse_rms = jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + eps)
    return (flat @ fn.T) * inverse_rms


@dataclasses.dataclass(frozen=True)
class IndependentHyperConnections:
    """HY-V4's iHC: ``streams`` parallel residual streams ``[T, n, H]``, the embeddings copied into
    each. Per sublayer, a hyper-connection (``<sublayer>_hc``: ``attn_hc``, ``ffn_hc``) reads the
    sublayer's input as a gated sum of the streams, normalised by the layer's RMSNorm, and writes
    the output back to every stream through its own gate: ``streams + post[..., None] * out``, in
    float32, rounded to the streams' dtype. No stream mixing matrix (DeepSeek V4's mHC adds one,
    Sinkhorn-normalised). The final hidden state is the learned head's collapse (``hc_head``), then
    the final norm. ``norm_eps``: the RMS of the mixes (the config's ``rms_norm_eps``)."""

    streams: int
    norm_eps: float
    hc_eps: float = 1e-6
    magnitude: float = 2.0

    def start(self, embeddings):
        return jnp.broadcast_to(embeddings[..., None, :], (*embeddings.shape[:-1], self.streams,
                                                            embeddings.shape[-1]))

    def _sublayer(self, streams, name: str, norm: str, parts: LayerParts, run):
        post, read = _HyperConnection(self.streams, self.norm_eps, self.hc_eps, self.magnitude, name=name)(streams)
        out = run(Rows(parts.rms_norm(norm, read)))
        written = post[..., None] * out.astype(jnp.float32)[..., None, :] + streams.astype(jnp.float32)
        return written.astype(streams.dtype)

    def layer(self, parts: LayerParts, streams):
        streams = self._sublayer(streams, "attn_hc", "input_layernorm", parts, parts.mix)
        return self._sublayer(streams, "ffn_hc", "post_attention_layernorm", parts, parts.feed_forward)

    def hidden(self, streams):
        """The streams as they are, ``[T, n, H]`` (HF's hidden states of such a model)."""
        return streams

    def finish(self, streams, final_norm):
        return final_norm(_HyperHead(self.streams, self.norm_eps, self.hc_eps, name="hc_head")(streams))


__all__ = ["IndependentHyperConnections", "LayerParts", "OneStream", "PreNormResidual", "SandwichResidual",
           "ScaledNormedResidual", "Stream"]
