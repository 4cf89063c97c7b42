"""Reading and writing a layer's per-sequence state slots (``jaxinfer.cache.specs.StateSlots``) from a
step's metadata, the same way for every linear-attention mixer.

A step's sequence ``s`` keeps its state in slot ``md.state_slots[s]`` (-1: a padding sequence). It
starts from zeros when ``md.fresh[s]`` (its first tokens: a new sequence, a recomputed one after
preemption, or a slot just handed over from a finished one), else from its slot. Only sequences with
tokens in the step write their slot back. Decode rows always continue a sequence (a prompt's first
tokens run in a mixed step), so the decode ops read the pool in place.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfer.cache.metadata import StepMetadata


def _per_sequence(mask, like):
    return mask.reshape(-1, *([1] * (like.ndim - 1)))


def sequence_states(pool, md: StepMetadata):
    """Each sequence's state at the start of the step: [S, *state] from ``pool`` [N, *state]."""
    slots = md.state_slots
    states = pool[jnp.maximum(slots, 0)]
    keep = (slots >= 0) & ~md.fresh
    return jnp.where(_per_sequence(keep, states), states, jnp.zeros((), pool.dtype))


def store_states(pool, md: StepMetadata, states):
    """``pool`` with each sequence's state after the step written to its slot (sequences without
    tokens in the step, and padding sequences, write nothing)."""
    has_tokens = (md.query_start[1:] > md.query_start[:-1]) & (md.state_slots >= 0)
    target = jnp.where(has_tokens, md.state_slots, pool.shape[0])  # out of range: dropped
    return pool.at[target].set(states.astype(pool.dtype), mode="drop")


def decode_slots(md: StepMetadata):
    """A decode step's slot per row: the row's sequence's, -1 for padding rows (finished rows of a
    decode loop included), which the decode ops neither read nor write."""
    return jnp.where(md.valid, md.state_slots, -1)


__all__ = ["decode_slots", "sequence_states", "store_states"]
