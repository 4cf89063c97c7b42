"""RMSNorm, in the two flavours HF uses."""

import flax.linen as nn
import jax.numpy as jnp

from jaxinfer.kernels.math import rms_norm


class RMSNorm(nn.Module):
    """``jaxinfer.kernels.math.rms_norm`` with its weight as a parameter: initialised to ones, or to
    zeros with ``unit_offset`` (Gemma, Qwen3-Next: ``x_normed * (1 + weight)``)."""

    eps: float
    unit_offset: bool = False
    float32_weight: bool = False
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        weight = self.param("weight", init, (x.shape[-1],), self.param_dtype)
        return rms_norm(x, weight, self.eps, unit_offset=self.unit_offset, float32_weight=self.float32_weight)



class NormWeight(nn.Module):
    """An RMSNorm's weight alone (initialised to ones, at ``<name>/weight`` as RMSNorm keeps it), for
    ops that apply the norm themselves."""

    size: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self):
        return self.param("weight", nn.initializers.ones, (self.size,), self.param_dtype)
