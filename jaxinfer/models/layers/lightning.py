"""The lightning attention mixer (MiniMax-Text-01's linear attention): a decaying sum of k^T v per
head, read by q, with an RMSNorm and a sigmoid output gate behind it.

Per token: ``qkv_proj`` gives per head ``[q | k | v]`` (``head_dim`` each), the config's activation
(SiLU) on all three, no scale; per head ``S = exp(-slope_h) * S + k^T v`` and ``o = q S``
(``jaxinfer.kernels.lightning``). The slope depends on the head and on the layer's **global** index:
``slope_h = (2 ** (-8 / H)) ** (h + 1) * (1 - layer / (L - 1 + 1e-5) + 1e-5)``, so the last layer
barely decays. The output is ``RMSNorm(o over all H * D, eps 1e-6) * sigmoid(output_gate(x))``, then
``out_proj``.

HF's checkpoint also stores the decay tables of its block-wise prefill (``slope_rate``,
``query_decay``, ``key_decay``, ``diagonal_decay``); they follow from the config and are not
parameters here. Each layer keeps per sequence the float32 state ``[H, D, D]``.

Tensor-parallel by head: ``qkv_proj`` and ``output_gate`` column-parallel (``qkv_proj``'s rows are per
head already), each device's slopes those of its heads, the output norm over every device's heads,
``out_proj`` row-parallel; the state splits by head.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cache.metadata import StepMetadata
from jaxinfer.cache.specs import StateSlots
from jaxinfer.errors import ConfigError
from jaxinfer.kernels import lightning as lightning_ops
from jaxinfer.models.layers.activations import get_activation
from jaxinfer.models.layers.linear import Linear, LinearParams
from jaxinfer.models.layers.linear_attention import run_recurrence
from jaxinfer.models.layers.norm import RMSNorm, SublayerInput
from jaxinfer.sharding import local
from jaxinfer.sharding.plan import HEADS

OUTPUT_NORM_EPS = 1e-6  # HF's MiniMaxRMSNorm default; the lightning output norm never reads rms_norm_eps
DECAY_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


def slopes(num_heads: int, layer_index: int, num_layers: int) -> np.ndarray:
    """The per-head decay rates of layer ``layer_index`` of ``num_layers``, float32 as HF computes them."""
    base = np.float32(1 / (2 ** (8 / num_heads)))
    factor = np.float32(1 - layer_index / (num_layers - 1 + 1e-5) + 1e-5)
    return (base ** np.arange(1, num_heads + 1, dtype=np.float32) * factor).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class LightningAttention:
    """A lightning attention mixer at global layer ``layer_index``; heads and head_dim are the config's."""

    layer_index: int
    name: str = "self_attn"

    def validate(self, config) -> None:
        get_activation(config.hidden_act)
        if not 0 <= self.layer_index < config.num_hidden_layers:
            raise ConfigError(f"lightning attention at layer {self.layer_index} of a "
                              f"{config.num_hidden_layers}-layer model")

    def cache_specs(self, config) -> tuple[StateSlots, ...]:
        h, d = config.num_attention_heads, config.head_dim
        return (StateSlots((("recurrent_state", (h, d, d), "float32", (HEADS, None, None)),)),)

    def rotary(self, config):
        return None

    def module(self, config, param_dtype) -> "LightningAttentionMixer":
        rates = slopes(config.num_attention_heads, self.layer_index, config.num_hidden_layers)
        return LightningAttentionMixer(num_heads=config.num_attention_heads, head_dim=config.head_dim,
                                       slopes=tuple(float(s) for s in rates), activation=config.hidden_act,
                                       param_dtype=param_dtype, name=self.name)


class LightningAttentionMixer(nn.Module):
    num_heads: int
    head_dim: int
    slopes: tuple[float, ...]  # per head (float32 values)
    activation: str = "silu"
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: SublayerInput, cache: dict, md: StepMetadata, rotary=None):
        """``x``: the block's input; ``cache``: {"recurrent_state"} -> (output, the updated cache)."""
        t, hidden = x.shape
        h, d = self.num_heads, self.head_dim
        local_h = local.local(h, HEADS)
        weights = [LinearParams(n, False, self.param_dtype, (HEADS, None), name=name)(hidden)[0]
                   for n, name in ((3 * h * d, "qkv_proj"), (h * d, "output_gate"))]
        qkv, gate = x.project(weights)
        qkv = get_activation(self.activation)(qkv).reshape(t, local_h, 3 * d)
        q, k, v = qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:]
        # The slopes of this device's heads: they depend on the global head index.
        slope = jax.lax.dynamic_slice_in_dim(jnp.asarray(np.asarray(self.slopes, np.float32)),
                                             local.index(HEADS) * local_h, local_h)
        out, state = run_recurrence(lightning_ops.lightning_attention, lightning_ops.recurrent_update,
                                    cache["recurrent_state"], md, q, k, v, slope)
        out = RMSNorm(OUTPUT_NORM_EPS, param_dtype=self.param_dtype, axis=HEADS, name="norm")(
            out.astype(x.dtype).reshape(t, local_h * d))
        out = jax.nn.sigmoid(gate) * out
        out = Linear(hidden, False, self.param_dtype, (None, HEADS), name="out_proj")(out)
        return out, {"recurrent_state": state}


__all__ = ["DECAY_BUFFERS", "LightningAttention", "LightningAttentionMixer", "slopes"]
