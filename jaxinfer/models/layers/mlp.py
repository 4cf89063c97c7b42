"""The gated MLP: ``down(act(gate(x)) * up(x))``."""

import flax.linen as nn
import jax.numpy as jnp

from jaxinfer.kernels import linear as linear_ops
from jaxinfer.models.layers.activations import get_activation
from jaxinfer.models.layers.linear import Linear, LinearParams
from jaxinfer.models.layers.norm import PreNorm


class GatedMLP(nn.Module):
    intermediate_size: int
    hidden_act: str = "silu"
    use_bias: bool = False
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, prenorm: PreNorm | None = None):
        """-> (output, the residual stream after ``prenorm``'s add; None without one)."""
        act = get_activation(self.hidden_act)
        gate_up = [LinearParams(self.intermediate_size, self.use_bias, self.param_dtype, name=name)(x.shape[-1])
                   for name in ("gate_proj", "up_proj")]
        weights, biases = [w for w, _ in gate_up], [b for _, b in gate_up]
        if prenorm is None:  # one op for the two (with the block's norm, when given)
            (gate, up), residual = linear_ops.project(x, weights, biases), None
        else:
            (gate, up), residual = prenorm.project(x, weights, biases)
        return Linear(x.shape[-1], self.use_bias, self.param_dtype, name="down_proj")(act(gate) * up), residual
