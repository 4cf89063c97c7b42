"""Kimi Delta Attention ops (KDA: Kimi Linear), over packed sequences with state.

KDA is the gated delta rule with a decay per key channel (g [.., H, Dk]) instead of one per head.
``kda`` runs a step's new tokens of several sequences (``cu_seqlens``) from their initial states and
returns the outputs and final states; ``recurrent_update`` advances one token per sequence (decode),
its state read from and written back to a pool of state slots; ``recurrent_step`` is one token of one
sequence. Implementations (``jaxinfer.kernels.registry``): the token-by-token recurrence
(``reference.py``, the truth); the chunked WY form (``chunked.py``, chunks of 64) wherever no kernel
takes the call; and where Pallas runs, the gated delta rule's Pallas kernels
(``jaxinfer.kernels.gated_delta.chunked_pallas`` and ``recurrent_pallas``), which take a gate per
key channel. q and k come L2-normalised, q scaled by ``Dk ** -0.5``; g is the log-decay (<= 0);
states are float32.
"""

from __future__ import annotations

from jaxinfer.kernels.gated_delta import chunked_pallas, recurrent_pallas
from jaxinfer.kernels.kda import chunked, reference
from jaxinfer.kernels.recurrence import recurrence_ops


kda_op, recurrent_update_op = recurrence_ops(
    "kda", "kda", reference, chunked.kda, (chunked_pallas.gated_delta_rule, chunked_pallas.supports),
    (recurrent_pallas.recurrent_update, recurrent_pallas.supports))


def kda(q, k, v, g, beta, cu_seqlens, initial_state):
    """q, k, g [T, H, Dk], v [T, H, Dv], beta [T, H]; cu_seqlens [S + 1]; initial_state [S, H, Dk, Dv]
    -> (outputs [T, H, Dv], final states [S, H, Dk, Dv]), float32; see the reference."""
    return kda_op(q, k, v, g, beta, cu_seqlens, initial_state)


def recurrent_step(state, q, k, v, g, beta):
    """One token per head: state [H, Dk, Dv], q/k/g [H, Dk], v [H, Dv], beta [H] -> (output, state)."""
    return reference.recurrent_step(state, q, k, v, g, beta)


def recurrent_update(state_pool, slots, q, k, v, g, beta):
    """One decode token per sequence: state_pool [N, H, Dk, Dv], slots [S] (-1: padding), q/k/g
    [S, H, Dk], v [S, H, Dv], beta [S, H] -> (outputs [S, H, Dv], the updated pool)."""
    return recurrent_update_op(state_pool, slots, q, k, v, g, beta)


__all__ = ["kda", "recurrent_step", "recurrent_update"]
