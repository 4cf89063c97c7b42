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

Each layer keeps per sequence a conv state (the last ``conv_kernel - 1`` conv inputs, in the cache
dtype) and the recurrent state ``[value_heads, key_head_dim, value_head_dim]`` in float32.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.cache.metadata import AttentionMetadata
from jaxinfer.cache.specs import StateSlots
from jaxinfer.errors import ConfigError
from jaxinfer.kernels import gated_delta as gated_delta_ops
from jaxinfer.models.layers.linear import Linear, LinearParams
from jaxinfer.models.layers.linear_attention import ConvWeight, l2_normalize, project_input, run_recurrence, short_conv
from jaxinfer.models.layers.norm import GatedRMSNorm, PreNorm

LAYOUTS = ("grouped", "flat")


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
            ("conv_state", (s["conv_kernel_dim"] - 1, conv_channels), None),
            ("recurrent_state", (s["num_value_heads"], s["key_head_dim"], s["value_head_dim"]), "float32"),
        )),)

    def rotary(self, config):
        return None

    def module(self, config, param_dtype) -> "GatedDeltaNetMixer":
        s = self.sizes(config)
        return GatedDeltaNetMixer(num_key_heads=s["num_key_heads"], num_value_heads=s["num_value_heads"],
                                  key_head_dim=s["key_head_dim"], value_head_dim=s["value_head_dim"],
                                  conv_kernel=s["conv_kernel_dim"], layout=self.layout, eps=config.rms_norm_eps,
                                  param_dtype=param_dtype, name=self.name)


class GatedDeltaNetMixer(nn.Module):
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    layout: str
    eps: float
    param_dtype: jnp.dtype = jnp.float32

    def _projections(self, x, prenorm):
        """-> (q [T, Hk*Dk], k [T, Hk*Dk], v [T, Hv*Dv], z [T, Hv, Dv], b [T, Hv], a [T, Hv], residual)."""
        t, hidden = x.shape
        hk, hv, dk, dv = self.num_key_heads, self.num_value_heads, self.key_head_dim, self.value_head_dim
        group = hv // hk
        param = lambda n, name: LinearParams(n, False, self.param_dtype, name=name)(hidden)[0]  # noqa: E731
        if self.layout == "grouped":
            weights = [param(hk * (2 * dk + 2 * group * dv), "in_proj_qkvz"), param(hv * 2, "in_proj_ba")]
            (qkvz, ba), residual = project_input(x, prenorm, weights)
            qkvz = qkvz.reshape(t, hk, 2 * dk + 2 * group * dv)
            q, k = qkvz[..., :dk], qkvz[..., dk:2 * dk]
            v, z = qkvz[..., 2 * dk:2 * dk + group * dv], qkvz[..., 2 * dk + group * dv:]
            ba = ba.reshape(t, hk, 2 * group)
            b, a = ba[..., :group].reshape(t, hv), ba[..., group:].reshape(t, hv)
            q, k, v = q.reshape(t, hk * dk), k.reshape(t, hk * dk), v.reshape(t, hv * dv)
        else:
            weights = [param(2 * hk * dk + hv * dv, "in_proj_qkv"), param(hv * dv, "in_proj_z"),
                       param(hv, "in_proj_b"), param(hv, "in_proj_a")]
            (qkv, z, b, a), residual = project_input(x, prenorm, weights)
            q, k, v = qkv[:, :hk * dk], qkv[:, hk * dk:2 * hk * dk], qkv[:, 2 * hk * dk:]
        return q, k, v, z.reshape(t, hv, dv), b, a, residual

    @nn.compact
    def __call__(self, x, cache: dict, md: AttentionMetadata, rotary=None, prenorm: PreNorm | None = None):
        """``cache``: {"conv_state", "recurrent_state"} -> (output, the updated cache, the residual
        stream after ``prenorm``'s add)."""
        t = x.shape[0]
        hk, hv, dk, dv = self.num_key_heads, self.num_value_heads, self.key_head_dim, self.value_head_dim
        q, k, v, z, b, a, residual = self._projections(x, prenorm)
        conv_weight = ConvWeight(2 * hk * dk + hv * dv, self.conv_kernel, self.param_dtype, name="conv1d")()
        mixed, conv_state = short_conv(jnp.concatenate([q, k, v], axis=-1), conv_weight, cache["conv_state"], md)
        group = hv // hk
        # Key head j // group feeds value head j (HF's repeat_interleave).
        q = jnp.repeat(l2_normalize(mixed[:, :hk * dk].reshape(t, hk, dk)), group, axis=1) * dk ** -0.5
        k = jnp.repeat(l2_normalize(mixed[:, hk * dk:2 * hk * dk].reshape(t, hk, dk)), group, axis=1)
        v = mixed[:, 2 * hk * dk:].reshape(t, hv, dv)
        a_log = self.param("A_log", nn.initializers.zeros, (hv,), self.param_dtype)
        dt_bias = self.param("dt_bias", nn.initializers.ones, (hv,), self.param_dtype)
        beta = jax.nn.sigmoid(b).astype(jnp.float32)  # in b's dtype, as HF
        g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
        out, recurrent_state = run_recurrence(gated_delta_ops.gated_delta_rule, gated_delta_ops.recurrent_update,
                                              cache["recurrent_state"], md, q, k, v, g, beta)
        out = GatedRMSNorm(self.eps, "silu", param_dtype=self.param_dtype, name="norm")(out.astype(x.dtype), z)
        out = Linear(x.shape[-1], False, self.param_dtype, name="out_proj")(out.reshape(t, hv * dv))
        return out, {"conv_state": conv_state, "recurrent_state": recurrent_state}, residual
