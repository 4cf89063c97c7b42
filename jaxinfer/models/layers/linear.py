"""Projections that keep HF's ``[out_features, in_features]`` weight layout.

Keeping the checkpoint's layout means weights stream from safetensors to the device without a
host-side transpose, and parameter paths mirror HF names one to one.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.kernels import linear as linear_ops

_INIT = nn.initializers.normal(stddev=0.02)


def _linear_params(module: nn.Module, features: int, in_features: int, use_bias: bool, param_dtype):
    weight = module.param("weight", _INIT, (features, in_features), param_dtype)
    bias = module.param("bias", nn.initializers.zeros, (features,), param_dtype) if use_bias else None
    return weight, bias


class Linear(nn.Module):
    features: int
    use_bias: bool = False
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        weight, bias = _linear_params(self, self.features, x.shape[-1], self.use_bias, self.param_dtype)
        return linear_ops.project(x, [weight], [bias])[0]


class LinearParams(nn.Module):
    """A ``Linear``'s parameters alone (``<name>/weight``, ``<name>/bias``), returned as
    ``(weight, bias or None)`` for ops that apply several projections at once."""

    features: int
    use_bias: bool = False
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, in_features: int):
        return _linear_params(self, self.features, in_features, self.use_bias, self.param_dtype)


class Embedding(nn.Module):
    num_embeddings: int
    features: int
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.weight = self.param("weight", _INIT, (self.num_embeddings, self.features), self.param_dtype)

    def __call__(self, token_ids):
        return jnp.take(self.weight, token_ids, axis=0)

    def attend(self, x):
        """Logits against the embedding matrix (tied LM head)."""
        return jax.lax.dot_general(x, self.weight.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())))
