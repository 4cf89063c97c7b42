"""Projections that keep HF's ``[out_features, in_features]`` weight layout, partitioned as vLLM's
layers are.

Keeping the checkpoint's layout means weights stream from safetensors to the device without a
host-side transpose, and parameter paths mirror HF names one to one.

``axes`` are the logical axes of the weight's ``[out, in]`` dimensions (``jaxinfer.sharding.plan``):
``(HEADS, None)`` is column-parallel (each device computes its heads' outputs from the whole input),
``(None, HEADS)`` row-parallel (each device takes its heads' part of the input; the partial outputs
are summed over the devices, once, and the bias added after). ``Embedding`` is vocabulary-parallel:
each device holds a block of rows, looks up the ids that fall in it, and the blocks' rows are summed.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.kernels import linear as linear_ops
from jaxinfer.quantization import as_array
from jaxinfer.sharding import local
from jaxinfer.sharding.plan import VOCAB

_INIT = nn.initializers.normal(stddev=0.02)
WHOLE = (None, None)


def _linear_params(module: nn.Module, features: int, in_features: int, use_bias: bool, param_dtype, axes):
    """The weight ``[features, in_features]`` (global sizes; ``in_features`` given as this device's
    share) and bias, as this device holds them. A weight kept in fp8 stays an ``Fp8Weight``: the
    projection ops take it as it is; anything else that reads it calls ``as_array``."""
    in_features = in_features * local.ways(axes[1])
    weight = local.param(module, "weight", _INIT, (features, in_features), axes, param_dtype)
    bias = (local.param(module, "bias", nn.initializers.zeros, (features,), axes[:1], param_dtype)
            if use_bias else None)
    return weight, bias


def row_parallel_sum(partial, bias, axes):
    """A row-parallel projection's output: the devices' partial sums added, then the bias."""
    out = local.sum_over(partial, axes[1]) if axes[1] is not None else partial
    return out if bias is None else out + bias.astype(out.dtype)


class Linear(nn.Module):
    features: int
    use_bias: bool = False
    param_dtype: jnp.dtype = jnp.float32
    axes: tuple = WHOLE  # logical axes of the weight's [out, in] dimensions
    reduce: bool = True  # False: a row-parallel projection returns this device's partial output (no bias)

    @nn.compact
    def __call__(self, x):
        weight, bias = _linear_params(self, self.features, x.shape[-1], self.use_bias, self.param_dtype, self.axes)
        if self.axes[1] is None:
            return linear_ops.project(x, [weight], [bias])[0]
        if not self.reduce:  # the caller sums it with other partial outputs of the same devices
            if bias is not None:
                raise ValueError("an unreduced row-parallel projection cannot add its bias")
            return linear_ops.project(x, [weight])[0]
        return row_parallel_sum(linear_ops.project(x, [weight])[0], bias, self.axes)


class LinearParams(nn.Module):
    """A ``Linear``'s parameters alone (``<name>/weight``, ``<name>/bias``), returned as
    ``(weight, bias or None)`` for ops that apply several projections at once. The weight may be an
    ``Fp8Weight`` (see ``_linear_params``)."""

    features: int
    use_bias: bool = False
    param_dtype: jnp.dtype = jnp.float32
    axes: tuple = WHOLE

    @nn.compact
    def __call__(self, in_features: int):
        """``in_features``: the input's width as this device sees it."""
        return _linear_params(self, self.features, in_features, self.use_bias, self.param_dtype, self.axes)


class Embedding(nn.Module):
    """The token embedding, vocabulary-parallel; ``attend`` is the tied LM head (logits gathered
    whole on every device)."""

    num_embeddings: int
    features: int
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.weight = as_array(local.param(self, "weight", _INIT, (self.num_embeddings, self.features), (VOCAB, None),
                                           self.param_dtype), self.param_dtype)

    def __call__(self, token_ids):
        if local.ways(VOCAB) == 1:
            return jnp.take(self.weight, token_ids, axis=0)
        rows = self.weight.shape[0]
        ids = token_ids - local.index(VOCAB) * rows
        mine = (ids >= 0) & (ids < rows)
        found = jnp.take(self.weight, jnp.where(mine, ids, 0), axis=0)
        return local.sum_over(jnp.where(mine[:, None], found, jnp.zeros_like(found)), VOCAB)

    def attend(self, x):
        """Logits against the embedding matrix (tied LM head)."""
        logits = jax.lax.dot_general(x, self.weight.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())))
        return local.gather(logits, VOCAB)
