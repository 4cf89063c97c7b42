"""The gated DeltaNet mixer (Qwen3-Next, Qwen3.5): a gated delta rule recurrence per value head, with
a depthwise causal conv in front and a gated RMSNorm behind.

Per token: projections give q, k (``num_key_heads`` heads of ``key_head_dim``), v and the output gate
z (``num_value_heads`` heads of ``value_head_dim``), and per value head b and a. The conv (width
``conv_kernel``, no bias) runs over the channels ``[Q_all | K_all | V_all]``, then SiLU; q and k are
L2-normalised (q also scaled by ``key_head_dim ** -0.5``); ``beta = sigmoid(b)``, ``g = -exp(A_log) *
softplus(a + dt_bias)``; key head ``j // (value_heads / key_heads)`` feeds value head ``j``. The
output per value head is ``norm.weight * rms_norm(o) * silu(z)``, then ``out_proj``.

The two families store the projections differently, and loading one layout as the other would be a
silent bug, so the layout is part of the spec: ``"grouped"`` (Qwen3-Next) keeps ``in_proj_qkvz``
grouped per key head as ``[q_h, k_h, v_group, z_group]`` and ``in_proj_ba`` as ``[b_group,
a_group]``; ``"flat"`` (Qwen3.5) has ``in_proj_qkv = [Q_all | K_all | V_all]``, ``in_proj_z``,
``in_proj_b`` and ``in_proj_a``.

Tensor-parallel by key head: each device holds whole key heads and the value heads they feed, so
the conv runs here in the channel order grouped per key head, ``[q_h | k_h | v of its group]``
(``grouped_channels``), which splits over devices in contiguous blocks whatever their number. The
checkpoint's conv weight (both families) and Qwen3.5's ``in_proj_qkv`` (``[Q_all | K_all | V_all]``
rows) are re-laid out into that order on load; Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba`` are
grouped already. ``out_proj`` is row-parallel.

Each layer keeps per sequence a conv state (the last ``conv_kernel - 1`` conv inputs, in the cache
dtype, channels grouped per key head) and the recurrent state ``[value_heads, key_head_dim,
value_head_dim]`` in float32, both split by head; ``states_as_hf`` gives them in HF's layout.
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
from jaxinfer.kernels import gated_delta as gated_delta_ops
from jaxinfer.models.layers.linear import Linear, LinearParams
from jaxinfer.models.layers.linear_attention import l2_normalize, run_recurrence, short_conv
from jaxinfer.models.layers.norm import GatedRMSNorm, SublayerInput
from jaxinfer.sharding import local
from jaxinfer.sharding.plan import HEADS

LAYOUTS = ("grouped", "flat")


def grouped_channels(num_key_heads: int, num_value_heads: int, key_head_dim: int, value_head_dim: int) -> np.ndarray:
    """The conv channels grouped per key head: entry ``i`` is the index in HF's ``[Q_all | K_all |
    V_all]`` order of grouped channel ``i``, key head ``h`` holding ``[q_h | k_h | v of value heads
    h*g .. (h+1)*g - 1]`` (``g = value_heads / key_heads``)."""
    hk, dk = num_key_heads, key_head_dim
    q = np.arange(hk * dk).reshape(hk, dk)
    v = 2 * hk * dk + np.arange(num_value_heads * value_head_dim).reshape(hk, -1)
    return np.concatenate([q, hk * dk + q, v], axis=1).reshape(-1)


@dataclasses.dataclass(frozen=True)
class GatedDeltaNet:
    """A gated DeltaNet mixer; sizes come from the config's ``linear_*`` fields."""

    layout: str  # "grouped" (Qwen3-Next) or "flat" (Qwen3.5): see the module docstring
    name: str = "linear_attn"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown projection layout {self.layout!r}; known: {LAYOUTS}")

    @staticmethod
    def sizes(config) -> dict[str, int]:
        return {key: config.int_field(f"linear_{key}", ge=1)
                for key in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel_dim")}

    def validate(self, config) -> None:
        s = self.sizes(config)
        if s["num_value_heads"] % s["num_key_heads"]:
            raise ConfigError(f"linear_num_value_heads ({s['num_value_heads']}) must be a multiple of "
                              f"linear_num_key_heads ({s['num_key_heads']}): each key head feeds a group of value heads")
        if s["conv_kernel_dim"] < 2:
            raise ConfigError(f"linear_conv_kernel_dim must be >= 2, got {s['conv_kernel_dim']}")

    def cache_specs(self, config) -> tuple[StateSlots, ...]:
        s = self.sizes(config)
        conv_channels = 2 * s["num_key_heads"] * s["key_head_dim"] + s["num_value_heads"] * s["value_head_dim"]
        return (StateSlots((
            ("conv_state", (s["conv_kernel_dim"] - 1, conv_channels), None, (None, HEADS)),  # grouped per key head
            ("recurrent_state", (s["num_value_heads"], s["key_head_dim"], s["value_head_dim"]), "float32",
             (HEADS, None, None)),
        )),)

    def channel_order(self, config) -> np.ndarray:
        """``grouped_channels`` of this config."""
        s = self.sizes(config)
        return grouped_channels(s["num_key_heads"], s["num_value_heads"], s["key_head_dim"], s["value_head_dim"])

    def states_as_hf(self, config, states: dict) -> dict:
        """Captured state-slot arrays ``[S, ...]`` in HF's layout: the conv state's channels back in
        ``[Q_all | K_all | V_all]`` order."""
        return {**states, "conv_state": states["conv_state"][..., np.argsort(self.channel_order(config))]}

    def rotary(self, config):
        return None

    def module(self, config, param_dtype) -> "GatedDeltaNetMixer":
        s = self.sizes(config)
        return GatedDeltaNetMixer(num_key_heads=s["num_key_heads"], num_value_heads=s["num_value_heads"],
                                  key_head_dim=s["key_head_dim"], value_head_dim=s["value_head_dim"],
                                  conv_kernel=s["conv_kernel_dim"], layout=self.layout, eps=config.rms_norm_eps,
                                  param_dtype=param_dtype, name=self.name)


class GroupedConvWeight(nn.Module):
    """The short conv's weight per key head, ``conv1d/weight [Hk, 2 Dk + g Dv, K]`` in the grouped
    channel order (re-laid out on load from the checkpoint's ``[C, 1, K]``), split by key head
    -> ``[C, K]`` of this device's channels."""

    num_key_heads: int
    channels_per_key_head: int
    width: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self):
        weight = local.param(self, "weight", nn.initializers.normal(0.1),
                             (self.num_key_heads, self.channels_per_key_head, self.width), (HEADS, None, None),
                             self.param_dtype)
        return weight.reshape(-1, self.width)


class GatedDeltaNetMixer(nn.Module):
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    layout: str
    eps: float
    param_dtype: jnp.dtype = jnp.float32

    def _projections(self, x: SublayerInput):
        """-> (qkv [T, Hk, 2 Dk + g Dv] grouped per key head, z [T, Hv, Dv], b [T, Hv], a [T, Hv]), of
        this device's heads."""
        t, hidden = x.shape
        hk, hv, dk, dv = self.num_key_heads, self.num_value_heads, self.key_head_dim, self.value_head_dim
        group = hv // hk
        per_key_head = 2 * dk + group * dv
        local_hk = local.local(hk, HEADS)
        local_hv = local.local(hv, HEADS)
        column = lambda n, name: LinearParams(n, False, self.param_dtype, (HEADS, None), name=name)(hidden)[0]  # noqa: E731
        if self.layout == "grouped":
            weights = [column(hk * (per_key_head + group * dv), "in_proj_qkvz"), column(hv * 2, "in_proj_ba")]
            qkvz, ba = x.project(weights)
            qkvz = qkvz.reshape(t, local_hk, per_key_head + group * dv)
            qkv, z = qkvz[..., :per_key_head], qkvz[..., per_key_head:]
            ba = ba.reshape(t, local_hk, 2 * group)
            b, a = ba[..., :group].reshape(t, local_hv), ba[..., group:].reshape(t, local_hv)
        else:  # in_proj_qkv's rows re-laid out per key head on load
            weights = [column(hk * per_key_head, "in_proj_qkv"), column(hv * dv, "in_proj_z"), column(hv, "in_proj_b"),
                       column(hv, "in_proj_a")]
            qkv, z, b, a = x.project(weights)
            qkv = qkv.reshape(t, local_hk, per_key_head)
        return qkv, z.reshape(t, local_hv, dv), b, a

    @nn.compact
    def __call__(self, x: SublayerInput, cache: dict, md: StepMetadata, rotary=None):
        """``x``: the block's input; ``cache``: {"conv_state", "recurrent_state"} -> (output, the
        updated cache)."""
        t = x.shape[0]
        hk, hv, dk, dv = self.num_key_heads, self.num_value_heads, self.key_head_dim, self.value_head_dim
        group = hv // hk
        qkv, z, b, a = self._projections(x)
        local_hk, per_key_head = qkv.shape[1], qkv.shape[2]
        conv_weight = GroupedConvWeight(hk, per_key_head, self.conv_kernel, self.param_dtype, name="conv1d")()
        mixed, conv_state = short_conv(qkv.reshape(t, local_hk * per_key_head), conv_weight, cache["conv_state"], md)
        mixed = mixed.reshape(t, local_hk, per_key_head)
        # Key head j // group feeds value head j (HF's repeat_interleave).
        q = jnp.repeat(l2_normalize(mixed[..., :dk]), group, axis=1) * dk ** -0.5
        k = jnp.repeat(l2_normalize(mixed[..., dk:2 * dk]), group, axis=1)
        v = mixed[..., 2 * dk:].reshape(t, local_hk * group, dv)
        a_log = local.param(self, "A_log", nn.initializers.zeros, (hv,), (HEADS,), self.param_dtype)
        dt_bias = local.param(self, "dt_bias", nn.initializers.ones, (hv,), (HEADS,), self.param_dtype)
        beta = jax.nn.sigmoid(b).astype(jnp.float32)  # in b's dtype, as HF
        g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
        out, recurrent_state = run_recurrence(gated_delta_ops.gated_delta_rule, gated_delta_ops.recurrent_update,
                                              cache["recurrent_state"], md, q, k, v, g, beta)
        out = GatedRMSNorm(self.eps, "silu", param_dtype=self.param_dtype, name="norm")(out.astype(x.dtype), z)
        out = Linear(x.shape[-1], False, self.param_dtype, (None, HEADS), name="out_proj")(out.reshape(t, -1))
        return out, {"conv_state": conv_state, "recurrent_state": recurrent_state}
