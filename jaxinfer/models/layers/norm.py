"""RMSNorm, in the two flavours HF uses, optionally with the residual add before it."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.kernels import linear as linear_ops
from jaxinfer.kernels import norm as norm_ops
from jaxinfer.kernels.math import apply_norm_weight
from jaxinfer.sharding import local


class RMSNorm(nn.Module):
    """``jaxinfer.kernels.math.rms_norm`` with its weight as a parameter: initialised to ones, or to
    zeros with ``unit_offset`` (Gemma, Qwen3-Next: ``x_normed * (1 + weight)``).

    ``norm(x)`` returns the normalised ``x``; ``norm(x, residual)`` adds first and returns
    ``(rms_norm(x + residual), x + residual)``, the sum being the new residual stream (one kernel
    on the GPU).

    ``axis``: the logical axis of the normalised dimension where it may be split (a norm over all
    heads, as MiniMax's q/k norms): the mean of squares is then taken over every device's piece.
    """

    eps: float
    unit_offset: bool = False
    float32_weight: bool = False
    param_dtype: jnp.dtype = jnp.float32
    axis: str | None = None

    @nn.compact
    def __call__(self, x, residual=None):
        init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        pieces = local.ways(self.axis)
        weight = local.param(self, "weight", init, (x.shape[-1] * pieces,), (self.axis,), self.param_dtype)
        if pieces > 1:
            if residual is not None:
                raise ValueError("a norm over a split dimension takes no residual")
            return _rms_norm_over_pieces(x, weight, self.eps, self.axis, unit_offset=self.unit_offset,
                                         float32_weight=self.float32_weight)
        normed, summed = norm_ops.add_rms_norm(x, residual, weight, self.eps, unit_offset=self.unit_offset,
                                               float32_weight=self.float32_weight)
        return normed if residual is None else (normed, summed)


def _rms_norm_over_pieces(x, weight, eps, axis, **options):
    """``rms_norm`` of a row split over the devices along ``axis``: each normalises its piece by the
    whole row's mean square."""
    x32 = x.astype(jnp.float32)
    mean_square = local.sum_over(jnp.sum(x32 * x32, axis=-1, keepdims=True), axis) / (x.shape[-1] * local.ways(axis))
    return apply_norm_weight(x32 * jax.lax.rsqrt(mean_square + eps), weight, x.dtype, **options)


class GatedRMSNorm(nn.Module):
    """HF's ``RMSNormGated`` over the last axis: ``weight * rms_norm(x) * act(gate)``, normalised in
    float32. ``activation`` "silu" (gated DeltaNet: the weight multiplied in ``x``'s dtype, as
    Qwen3-Next does) or "sigmoid" with ``float32_weight`` (Kimi's KDA: all in float32)."""

    eps: float
    activation: str = "silu"
    float32_weight: bool = False
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, gate):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.float32_weight:
            normed = weight.astype(jnp.float32) * x32
        else:  # rounded to x's dtype before the gate, as HF
            normed = (weight * x32.astype(x.dtype)).astype(jnp.float32)
        act = jax.nn.silu if self.activation == "silu" else jax.nn.sigmoid
        return (normed * act(gate.astype(jnp.float32))).astype(x.dtype)


class LayerNorm(nn.Module):
    """``torch.nn.LayerNorm`` with weight and bias (``<name>/weight``, ``<name>/bias``), computed in
    float32 and returned in ``x``'s dtype."""

    eps: float
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        normed = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (normed * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


class NormWeight(nn.Module):
    """An RMSNorm's weight alone (at ``<name>/weight`` as RMSNorm keeps it; initialised to ones, or to
    zeros for a ``unit_offset`` norm), for ops that apply the norm themselves."""

    size: int
    param_dtype: jnp.dtype = jnp.float32
    init: str = "ones"  # "ones" or "zeros"

    @nn.compact
    def __call__(self):
        init = nn.initializers.zeros if self.init == "zeros" else nn.initializers.ones
        return self.param("weight", init, (self.size,), self.param_dtype)


class SublayerInput:
    """What a mixer or feed-forward reads: its input rows, normalised as its residual scheme wants.

    ``project(weights, biases)`` applies the sublayer's first projections (``nn.Linear`` weights, one
    op) to the rows; ``normed()`` is the rows themselves; ``shape`` and ``dtype`` are theirs. A
    sublayer reads its input once, one way or the other, and returns only its output: the residual
    stream belongs to the scheme (``jaxinfer.models.residual``).
    """

    shape: tuple[int, ...]
    dtype: jnp.dtype

    def project(self, weights, biases=None) -> tuple:
        raise NotImplementedError

    def normed(self) -> jax.Array:
        raise NotImplementedError


class Rows(SublayerInput):
    """Rows already in the form the sublayer reads (normalised by the scheme, or never)."""

    def __init__(self, rows):
        self.rows, self.shape, self.dtype = rows, rows.shape, rows.dtype

    def project(self, weights, biases=None) -> tuple:
        return linear_ops.project(self.rows, weights, biases)

    def normed(self) -> jax.Array:
        return self.rows


class PreNormed(SublayerInput):
    """A pre-norm block's residual add + RMSNorm, left for the block's first projections to apply:
    ``project`` is ``x + residual``, its RMSNorm and the projections of the normalised rows as one op
    (``jaxinfer.kernels.linear.norm_project``; at a one-token step on the GPU one launch, which never
    waits for the norm). ``residual=None`` (the first block) normalises ``x`` alone. Reading it either
    way forms the stream after the add, ``summed``, which the residual scheme carries on."""

    def __init__(self, x, residual, weight, eps: float, *, unit_offset: bool = False, float32_weight: bool = False):
        self.x, self.residual, self.weight, self.eps = x, residual, weight, eps
        self.unit_offset, self.float32_weight = unit_offset, float32_weight
        self.shape, self.dtype = x.shape, x.dtype
        self._summed = None

    def project(self, weights, biases=None) -> tuple:
        outputs, self._summed = linear_ops.norm_project(self.x, self.residual, self.weight, weights, biases,
                                                        eps=self.eps, unit_offset=self.unit_offset,
                                                        float32_weight=self.float32_weight)
        return outputs

    def normed(self) -> jax.Array:
        normed, self._summed = norm_ops.add_rms_norm(self.x, self.residual, self.weight, self.eps,
                                                     unit_offset=self.unit_offset, float32_weight=self.float32_weight)
        return normed

    @property
    def summed(self) -> jax.Array:
        """The residual stream after the add: ``x + residual`` (``x`` for the first block)."""
        if self._summed is None:
            raise ValueError("the sublayer never read its input (project or normed), so its residual add never ran")
        return self._summed
