"""How a per-head recurrence (gated delta rule, KDA, lightning attention) runs over a step: the loops
every one of them shares, each given the recurrence's own step.

``scan_packed``: token by token over packed sequences (``cu_seqlens``), each starting from its
initial state, given the one-token ``step(state, *token_inputs, *shared) -> (output, state)``; rows
past ``cu_seqlens[-1]`` are padding (zero output, no state touched), and a sequence with no rows
keeps its initial state (the references). ``update_slots``: one token per sequence, the state read
from and written back to a slot pool (slot -1: a padding row, nothing read or written, zero output).

The chunked forms: ``Chunks`` cuts each sequence's rows into chunks of its own (at most ``T / chunk
+ S`` for the step; a chunk's rows past its sequence's end are zeros, so every chunk's state is
exact), and ``scan_chunks`` carries the state over them with the recurrence's chunk step, loading a
sequence's initial state at its first chunk and keeping the state after its last as its final
state. Everything in float32. ``recurrence_ops`` registers a recurrence's two ops.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxinfer.kernels.registry import Implementation, Op, where_pallas_runs


def _f32(x):
    return x.astype(jnp.float32)


def scan_packed(step, token_inputs, cu_seqlens, initial_state, shared=()):
    """``token_inputs``: arrays [T, ...]; ``shared``: arrays every token reads (a per-head slope)
    -> (outputs [T, ...] float32, final states [S, ...] float32)."""
    num_tokens = token_inputs[0].shape[0]
    rows = jnp.arange(num_tokens)
    seq = jnp.searchsorted(cu_seqlens[1:], rows, side="right")  # the sequence of each row
    valid = rows < cu_seqlens[-1]
    first = valid & (rows == cu_seqlens[jnp.minimum(seq, cu_seqlens.shape[0] - 2)])
    shared = tuple(map(_f32, shared))

    def one_token(carry, xs):
        state, finals = carry
        *inputs, s, is_valid, is_first = xs
        s = jnp.minimum(s, finals.shape[0] - 1)
        state = jnp.where(is_first, finals[s], state)  # a sequence starts from its initial state
        out, new_state = step(state, *inputs, *shared)
        state = jnp.where(is_valid, new_state, state)
        finals = jnp.where(is_valid, finals.at[s].set(state), finals)
        return (state, finals), jnp.where(is_valid, out, 0.0)

    init = (jnp.zeros(initial_state.shape[1:], jnp.float32), _f32(initial_state))
    (_, finals), outputs = jax.lax.scan(one_token, init, (*map(_f32, token_inputs), seq, valid, first))
    return outputs, finals


def update_slots(step, state_pool, slots, row_inputs, shared=()):
    """``row_inputs``: arrays [S, ...], one row per sequence -> (outputs [S, ...] float32, the pool)."""
    states = _f32(state_pool[jnp.maximum(slots, 0)])
    in_axes = (0,) * (1 + len(row_inputs)) + (None,) * len(shared)
    out, states = jax.vmap(step, in_axes=in_axes)(states, *map(_f32, row_inputs), *map(_f32, shared))
    keep = slots >= 0
    target = jnp.where(keep, slots, state_pool.shape[0])  # out of range: dropped
    state_pool = state_pool.at[target].set(states.astype(state_pool.dtype), mode="drop")
    return jnp.where(keep.reshape(-1, *([1] * (out.ndim - 1))), out, 0.0), state_pool


def chunk_table(cu_seqlens, num_tokens: int, chunk: int):
    """The step's chunks: (sequence, first row, rows, is the sequence's first chunk) per chunk,
    ``num_tokens // chunk + S`` of them (unused ones have no rows)."""
    num_seqs = cu_seqlens.shape[0] - 1
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(-(-lengths // chunk)).astype(jnp.int32)])
    index = jnp.arange(num_tokens // chunk + num_seqs, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(offsets[1:], index, side="right"), num_seqs - 1).astype(jnp.int32)
    start = cu_seqlens[seq] + (index - offsets[seq]) * chunk
    rows = jnp.where(index < offsets[-1], jnp.clip(cu_seqlens[seq + 1] - start, 0, chunk), 0)
    return seq, start, rows, index == offsets[seq]


class Chunks(NamedTuple):
    """A step's packed sequences in chunks (``chunk_table``): per chunk its sequence, whether it is
    the sequence's first and how many rows it has; ``index [N, C]`` the token row of each chunk row,
    ``inside [N, C]`` whether that chunk row holds one."""

    seq: jax.Array
    first: jax.Array
    rows: jax.Array
    index: jax.Array
    inside: jax.Array
    num_tokens: int

    @classmethod
    def of(cls, cu_seqlens, num_tokens: int, chunk: int) -> "Chunks":
        seq, start, rows, first = chunk_table(cu_seqlens.astype(jnp.int32), num_tokens, chunk)
        offsets = jnp.arange(chunk, dtype=jnp.int32)
        return cls(seq, first, rows, start[:, None] + offsets[None, :], offsets[None, :] < rows[:, None], num_tokens)

    def gather(self, x):
        """Token rows ``x [T, ...]`` -> chunk rows ``[N, C, ...]`` in float32, zeros past a chunk's rows."""
        inside = self.inside.reshape(*self.inside.shape, *([1] * (x.ndim - 1)))
        return jnp.where(inside, x.astype(jnp.float32)[jnp.clip(self.index, 0, self.num_tokens - 1)], 0.0)

    def scatter(self, outs):
        """Chunk rows ``outs [N, C, ...]`` back to token rows ``[T, ...]`` (each token is one row of one chunk)."""
        out = jnp.zeros((self.num_tokens + 1, *outs.shape[2:]), outs.dtype)
        target = jnp.where(self.inside, self.index, self.num_tokens)  # rows past a chunk's end: dropped
        return out.at[target.reshape(-1)].set(outs.reshape(-1, *outs.shape[2:]), mode="drop")[:self.num_tokens]


def scan_chunks(chunk_step, chunks: Chunks, per_chunk, initial_state):
    """``chunk_step(state, *inputs) -> (output, state)`` over the step's chunks in order, ``per_chunk``
    its inputs with a leading chunk axis -> (outputs [N, ...], final states [S, ...] float32)."""
    def step(carry, xs):
        state, finals = carry
        s, is_first, has_rows, *inputs = xs
        state = jnp.where(is_first, finals[s], state)
        out, new_state = chunk_step(state, *inputs)
        state = jnp.where(has_rows, new_state, state)
        finals = jnp.where(has_rows, finals.at[s].set(state), finals)
        return (state, finals), out

    init = (jnp.zeros(initial_state.shape[1:], jnp.float32), _f32(initial_state))
    (_, finals), outs = jax.lax.scan(step, init, (chunks.seq, chunks.first, chunks.rows > 0, *per_chunk))
    return outs, finals


def _any_call(target, *args, **options) -> bool:
    return True


def recurrence_ops(family: str, prefill: str, reference, chunked, prefill_kernel, decode_kernel):
    """The two ops of a linear-attention recurrence: ``<family>.<prefill>`` over packed sequences from
    their initial states (the Pallas chunked kernel where it takes the call, else the chunked jnp
    form ``chunked``; ``reference.<prefill>`` the token-by-token truth) and
    ``<family>.recurrent_update``, the decode step over the slot pool (the Pallas kernel where it
    takes the call). ``prefill_kernel`` / ``decode_kernel``: (function, its ``supports`` check)."""
    prefill_op = Op(f"{family}.{prefill}", getattr(reference, prefill), (
        Implementation("triton", prefill_kernel[0], where_pallas_runs(prefill_kernel[1])),
        Implementation("chunked", chunked, _any_call, pallas=False),
    ))
    decode_op = Op(f"{family}.recurrent_update", reference.recurrent_update, (
        Implementation("triton", decode_kernel[0], where_pallas_runs(decode_kernel[1])),
    ))
    return prefill_op, decode_op


__all__ = ["Chunks", "chunk_table", "recurrence_ops", "scan_chunks", "scan_packed", "update_slots"]
