"""The gated MLP: ``down(act(gate(x)) * up(x))``; tensor-parallel over its width (gate/up
column-parallel, down row-parallel: one sum over the devices)."""

import flax.linen as nn
import jax.numpy as jnp

from jaxinfer.models.layers.activations import get_activation
from jaxinfer.models.layers.linear import Linear, LinearParams
from jaxinfer.models.layers.norm import SublayerInput
from jaxinfer.sharding.plan import MLP


class GatedMLP(nn.Module):
    intermediate_size: int
    hidden_act: str = "silu"
    use_bias: bool = False
    param_dtype: jnp.dtype = jnp.float32
    reduce: bool = True  # False: the output is this device's partial sum, for the caller to sum once

    @nn.compact
    def __call__(self, x: SublayerInput):
        """``x``: the block's input (its pending norm folded into the gate/up op) -> the output."""
        act = get_activation(self.hidden_act)
        gate_up = [LinearParams(self.intermediate_size, self.use_bias, self.param_dtype, (MLP, None),
                                name=name)(x.shape[-1])
                   for name in ("gate_proj", "up_proj")]
        weights, biases = [w for w, _ in gate_up], [b for _, b in gate_up]
        gate, up = x.project(weights, biases)  # one op for the two (with the block's norm, when pending)
        down = Linear(x.shape[-1], self.use_bias, self.param_dtype, (None, MLP), self.reduce, name="down_proj")
        return down(act(gate) * up)
