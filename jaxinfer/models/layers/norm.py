"""RMSNorm, in the two flavours HF uses."""

import flax.linen as nn
import jax
import jax.numpy as jnp


class RMSNorm(nn.Module):
    """Normalises in float32.

    ``unit_offset=False`` (Llama, Qwen, Mistral): ``weight * x_normed.astype(input_dtype)``, the
    weight initialised to ones; with ``float32_weight`` (GPT-OSS) the product is taken in float32
    and cast back. ``unit_offset=True`` (Gemma, Qwen3-Next): ``x_normed * (1 + weight)`` computed in
    float32 and cast back, the weight initialised to zeros. The variants differ only below float32.
    """

    eps: float
    unit_offset: bool = False
    float32_weight: bool = False
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        weight = self.param("weight", init, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
        if self.float32_weight:
            return (weight.astype(jnp.float32) * x32).astype(x.dtype)
        return weight * x32.astype(x.dtype)

