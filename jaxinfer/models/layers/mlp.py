"""The gated MLP: ``down(act(gate(x)) * up(x))``."""

import flax.linen as nn
import jax.numpy as jnp

from jaxinfer.models.layers.activations import get_activation
from jaxinfer.models.layers.linear import Linear


class GatedMLP(nn.Module):
    intermediate_size: int
    hidden_act: str = "silu"
    use_bias: bool = False
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        act = get_activation(self.hidden_act)
        dense = lambda n, name: Linear(n, self.use_bias, self.param_dtype, name=name)  # noqa: E731
        hidden = act(dense(self.intermediate_size, "gate_proj")(x)) * dense(self.intermediate_size, "up_proj")(x)
        return dense(x.shape[-1], "down_proj")(hidden)
