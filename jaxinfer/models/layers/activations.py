"""HF ``hidden_act`` names -> functions, with HF's exact definitions."""

import jax
import jax.numpy as jnp

from jaxinfer.errors import ConfigError

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),
}


def get_activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ConfigError(f"hidden_act {name!r} is not supported; supported: {', '.join(sorted(ACTIVATIONS))}") from None
