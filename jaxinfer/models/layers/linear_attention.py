"""Pieces every linear-attention mixer shares (gated DeltaNet, KDA, lightning attention): the input
projections with the block's pre-norm, the depthwise short convolution with its per-sequence conv
state, L2-normalised heads, and running a recurrence over a step from the sequences' state slots.

Prefill and mixed steps run the chunked ops over the packed rows (``md.query_start``) from each
sequence's state (``jaxinfer.models.layers.state``) and store the final states; decode steps run the
one-token ops, which read and write the slot pool in place.

Tensor-parallel by head: each device projects, convolves and runs the recurrence of its heads (their
conv channels, their state slots' rows), and the output projection is row-parallel.
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.cache.metadata import StepMetadata
from jaxinfer.kernels import conv1d as conv_ops
from jaxinfer.models.layers.state import decode_slots, sequence_states, store_states
from jaxinfer.sharding import local

L2_NORM_EPS = 1e-6  # HF's l2norm (and flash-linear-attention's): x * rsqrt(sum(x^2) + eps)


def l2_normalize(x):
    """HF's ``l2norm`` over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_NORM_EPS)


class ConvWeight(nn.Module):
    """A depthwise ``nn.Conv1d``'s weight as the checkpoint keeps it, ``<name>/weight [C, 1, K]``, its
    channels split over ``axis`` (``HEADS``: each device holds its heads' channels) -> ``[C, K]``."""

    channels: int
    width: int
    param_dtype: jnp.dtype = jnp.float32
    axis: str | None = None

    @nn.compact
    def __call__(self):
        weight = local.param(self, "weight", nn.initializers.normal(0.1), (self.channels, 1, self.width),
                             (self.axis, None, None), self.param_dtype)
        return weight[:, 0, :]


def short_conv(x, weight, pool, md: StepMetadata, activation: str | None = "silu"):
    """The step's rows ``x [T, C]`` through the causal conv ``weight [C, K]``, each sequence
    continuing from its conv state (its last ``K - 1`` inputs) -> (y [T, C], the updated pool)."""
    if md.decode:
        slots = decode_slots(md)
        y, states = conv_ops.causal_conv1d_step(x, weight, None, pool[jnp.maximum(slots, 0)], activation=activation)
        target = jnp.where(slots >= 0, slots, pool.shape[0])
        return y, pool.at[target].set(states.astype(pool.dtype), mode="drop")
    y, finals = conv_ops.causal_conv1d(x, weight, None, md.query_start, sequence_states(pool, md),
                                       activation=activation)
    return y, store_states(pool, md, finals)


def run_recurrence(prefill: Callable, decode_update: Callable, pool, md: StepMetadata, *inputs, **options):
    """A recurrence over the step from the sequences' states: ``prefill(*inputs, cu_seqlens,
    initial_states, **options) -> (out, finals)`` for prefill and mixed steps, ``decode_update(pool,
    slots, *inputs, **options) -> (out, pool)`` at decode -> (out, the updated pool)."""
    if md.decode:
        return decode_update(pool, decode_slots(md), *inputs, **options)
    out, finals = prefill(*inputs, md.query_start, sequence_states(pool, md), **options)
    return out, store_states(pool, md, finals)


__all__ = ["ConvWeight", "l2_normalize", "run_recurrence", "short_conv"]
