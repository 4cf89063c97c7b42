"""The KDA mixer (Kimi Delta Attention, Kimi-Linear): a gated delta rule whose decay is per key
channel, with short convs in front and a sigmoid-gated RMSNorm behind.

Per token, with ``H`` heads of ``d`` (``linear_num_heads``, ``linear_head_dim``): q, k and v come
from their own projections, each through its own depthwise causal conv (``q_conv1d``, ``k_conv1d``,
``v_conv1d``, no bias) and then ``hidden_act`` (SiLU); q and k are L2-normalised, q scaled by
``d ** -0.5``; ``beta = sigmoid(b_proj(x))`` per head; the log-decay per channel is
``g[h, c] = -exp(A_log[h]) * softplus(f_b_proj(f_a_proj(x))[h*d + c] + dt_bias[h*d + c])``, in
float32. The output per head is ``o_norm.weight * rms_norm(o) * sigmoid(g_b_proj(g_a_proj(x)))``,
all in float32 (not SiLU as in gated DeltaNet), then ``o_proj``. The checkpoint keeps ``A_log`` as
``[1, 1, H, 1]`` and ``dt_bias`` as ``[H * d]``, the latter in float32 whatever the serving dtype.

Bailing-MoE-V3's variant (``full_rank_gates``) projects the decay and the output gate at full rank,
``forget_gate.f_proj`` and ``g_proj`` (``[H * d, hidden]``), keeps ``forget_gate.A_log`` as ``[H]`` and
``forget_gate.dt_bias``, both float32, and rounds the decay to the serving dtype before the recurrence,
as HF's forget gate returns it. The "safe" gate (``safe_gate_lower_bound`` b < 0, Bailing-MoE-V3's
``kda_lower_bound``) bounds the log-decay to ``(b, 0)``: ``g = b * sigmoid(exp(A_log[h]) * (f + dt_bias))``. ``float32_conv``: the conv weights
are kept in float32 (the conv runs in float32 either way, its output rounded to the serving dtype).

Tensor-parallel by head: each device projects its heads' q, k, v, decay (``f_b_proj``, or ``f_proj``)
and gate (``g_b_proj``, or ``g_proj``) rows, Kimi's from the whole low-rank ``f_a_proj`` / ``g_a_proj``
outputs (which every device computes), holds their conv channels, ``A_log`` and ``dt_bias`` entries
and state rows; ``o_proj`` is row-parallel.

Each layer keeps per sequence a conv state (the last ``kernel - 1`` inputs of the three convs, in the
cache dtype) ``[kernel - 1, 3, H * d]``, the three convs' channels apart so that each splits by head
(HF's ``[q | k | v]`` channels are its last two axes flattened: ``states_as_hf``), and the recurrent
state ``[H, d, d]`` in float32.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.cache.metadata import StepMetadata
from jaxinfer.cache.specs import StateSlots
from jaxinfer.errors import ConfigError
from jaxinfer.kernels import kda as kda_ops
from jaxinfer.models.layers.linear import Linear, LinearParams
from jaxinfer.models.layers.linear_attention import ConvWeight, l2_normalize, run_recurrence, short_conv
from jaxinfer.models.layers.norm import GatedRMSNorm, SublayerInput
from jaxinfer.sharding import local
from jaxinfer.sharding.plan import HEADS

CONV_ACTIVATIONS = {"silu": "silu", "swish": "silu"}  # hidden_act names the short-conv op implements


@dataclasses.dataclass(frozen=True)
class KDA:
    """A KDA mixer; sizes come from the config's ``linear_*`` fields (HF's config class reads them
    from a hub config's ``linear_attn_config``)."""

    full_rank_gates: bool = False  # Bailing-MoE-V3's forget_gate.f_proj and g_proj, not Kimi's low-rank pairs
    safe_gate_lower_bound: float | None = None  # the "safe" gate: log-decay in (bound, 0)
    float32_conv: bool = False  # conv weights in float32, as HF keeps Bailing-MoE-V3's
    name: str = "self_attn"

    @staticmethod
    def sizes(config) -> dict[str, int]:
        return {"num_heads": config.int_field("linear_num_heads", ge=1),
                "head_dim": config.int_field("linear_head_dim", ge=1),
                "conv_kernel_dim": config.int_field("linear_conv_kernel_dim", ge=2)}  # a state of kernel - 1 inputs

    def validate(self, config) -> None:
        self.sizes(config)
        if config.hidden_act not in CONV_ACTIVATIONS:
            raise ConfigError(f"hidden_act {config.hidden_act!r} is not supported by KDA's short convolutions; "
                              f"supported: {', '.join(sorted(CONV_ACTIVATIONS))}")

    def cache_specs(self, config) -> tuple[StateSlots, ...]:
        s = self.sizes(config)
        return (StateSlots((
            ("conv_state", (s["conv_kernel_dim"] - 1, 3, s["num_heads"] * s["head_dim"]), None, (None, None, HEADS)),
            ("recurrent_state", (s["num_heads"], s["head_dim"], s["head_dim"]), "float32", (HEADS, None, None)),
        )),)

    def states_as_hf(self, config, states: dict) -> dict:
        """Captured state-slot arrays ``[S, ...]`` in HF's layout: the conv state's channels as
        ``[q | k | v]``."""
        conv = states["conv_state"]
        return {**states, "conv_state": conv.reshape(*conv.shape[:-2], -1)}

    def rotary(self, config):
        return None

    def module(self, config, param_dtype) -> "KimiDeltaAttention":
        s = self.sizes(config)
        return KimiDeltaAttention(num_heads=s["num_heads"], head_dim=s["head_dim"], conv_kernel=s["conv_kernel_dim"],
                                  activation=CONV_ACTIVATIONS.get(config.hidden_act, "silu"), eps=config.rms_norm_eps,
                                  full_rank_gates=self.full_rank_gates,
                                  safe_gate_lower_bound=self.safe_gate_lower_bound, float32_conv=self.float32_conv,
                                  param_dtype=param_dtype, name=self.name)


class ForgetGateParams(nn.Module):
    """Bailing-MoE-V3's ``forget_gate``: its full-rank ``f_proj`` weight, ``A_log [H]`` and
    ``dt_bias [H * d]`` (both float32, as HF keeps them), this device's heads -> (weight, A_log, dt_bias)."""

    num_heads: int
    head_dim: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, hidden: int):
        h, d = self.num_heads, self.head_dim
        weight = LinearParams(h * d, False, self.param_dtype, (HEADS, None), name="f_proj")(hidden)[0]
        a_log = local.param(self, "A_log", nn.initializers.zeros, (h,), (HEADS,), jnp.float32)
        dt_bias = local.param(self, "dt_bias", nn.initializers.zeros, (h * d,), (HEADS,), jnp.float32)
        return weight, a_log, dt_bias


class KimiDeltaAttention(nn.Module):
    num_heads: int
    head_dim: int
    conv_kernel: int
    activation: str
    eps: float
    full_rank_gates: bool = False
    safe_gate_lower_bound: float | None = None
    float32_conv: bool = False
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: SublayerInput, cache: dict, md: StepMetadata, rotary=None):
        """``x``: the block's input; ``cache``: {"conv_state", "recurrent_state"} -> (output, the
        updated cache)."""
        t, hidden = x.shape
        h, d = self.num_heads, self.head_dim
        local_h = local.local(h, HEADS)
        param = lambda n, name, axis: LinearParams(n, False, self.param_dtype, (axis, None), name=name)(hidden)[0]  # noqa: E731
        # Every projection of the block's input, in one op with the block's norm; Kimi's low-rank f_a / g_a whole.
        weights = [param(h * d, "q_proj", HEADS), param(h * d, "k_proj", HEADS), param(h * d, "v_proj", HEADS)]
        if self.full_rank_gates:
            f_weight, a_log, dt_bias = ForgetGateParams(h, d, self.param_dtype, name="forget_gate")(hidden)
            weights += [f_weight, param(h, "b_proj", HEADS), param(h * d, "g_proj", HEADS)]
        else:
            weights += [param(d, "f_a_proj", None), param(h, "b_proj", HEADS), param(d, "g_a_proj", None)]
        q, k, v, f, b, gate = x.project(weights)

        conv_dtype = jnp.float32 if self.float32_conv else self.param_dtype
        conv_weight = jnp.concatenate([ConvWeight(h * d, self.conv_kernel, conv_dtype, HEADS, name=f"{n}_conv1d")()
                                       for n in "qkv"])
        pool = cache["conv_state"]  # [slots, K - 1, 3, local channels]: as the conv input [q | k | v]
        mixed, conv_state = short_conv(jnp.concatenate([q, k, v], axis=-1), conv_weight,
                                       pool.reshape(*pool.shape[:2], -1), md, activation=self.activation)
        mixed = mixed.reshape(t, 3, local_h, d)
        q = l2_normalize(mixed[:, 0]) * d ** -0.5
        k = l2_normalize(mixed[:, 1])
        v = mixed[:, 2]

        if not self.full_rank_gates:
            a_log = local.param(self, "A_log", nn.initializers.zeros, (1, 1, h, 1), (None, None, HEADS, None),
                                self.param_dtype)
            dt_bias = local.param(self, "dt_bias", nn.initializers.zeros, (h * d,), (HEADS,), jnp.float32)  # as HF
            f = Linear(h * d, False, self.param_dtype, (HEADS, None), name="f_b_proj")(f)
            gate = Linear(h * d, False, self.param_dtype, (HEADS, None), name="g_b_proj")(gate)
        f = (f.astype(jnp.float32) + dt_bias).reshape(t, local_h, d)
        rate = jnp.exp(a_log.astype(jnp.float32)).reshape(local_h, 1)
        if self.safe_gate_lower_bound is None:
            g = -rate * jax.nn.softplus(f)
        else:
            g = self.safe_gate_lower_bound * jax.nn.sigmoid(rate * f)
        if self.full_rank_gates:
            g = g.astype(x.dtype).astype(jnp.float32)  # Bailing's forget gate returns the serving dtype, as HF
        beta = jax.nn.sigmoid(b).astype(jnp.float32)  # in b's dtype, as HF
        out, recurrent_state = run_recurrence(kda_ops.kda, kda_ops.recurrent_update, cache["recurrent_state"], md,
                                              q, k, v, g, beta)

        out = GatedRMSNorm(self.eps, "sigmoid", float32_weight=True, param_dtype=self.param_dtype, name="o_norm")(
            out.astype(x.dtype), gate.reshape(t, local_h, d))
        out = Linear(hidden, False, self.param_dtype, (None, HEADS), name="o_proj")(out.reshape(t, local_h * d))
        return out, {"conv_state": conv_state.reshape(pool.shape), "recurrent_state": recurrent_state}
