"""Projections that keep HF's ``[out_features, in_features]`` weight layout.

Keeping the checkpoint's layout means weights stream from safetensors to the device without a
host-side transpose, and parameter paths mirror HF names one to one.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

_INIT = nn.initializers.normal(stddev=0.02)


class Linear(nn.Module):
    features: int
    use_bias: bool = False
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", _INIT, (self.features, x.shape[-1]), self.param_dtype)
        y = jax.lax.dot_general(x, weight.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())))
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype).astype(y.dtype)
        return y


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
