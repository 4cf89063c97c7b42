"""Gated delta rule ops (gated DeltaNet: Qwen3-Next, Qwen3.5), over packed sequences with state.

``gated_delta_rule`` runs a step's new tokens of several sequences (``cu_seqlens``) from their
initial states and returns the outputs and final states; ``recurrent_update`` advances one token per
sequence (decode), its state read from and written back to a pool of state slots; ``recurrent_step``
is one token of one sequence. Implementations (``jaxinfer.kernels.registry``): the token-by-token recurrence
(``reference.py``, the truth); the chunked WY form (``chunked.py``, chunks of 64), wherever no kernel
takes the call; and where Pallas runs, the Pallas (Triton lowering) kernels: ``chunked_pallas.py``
(the chunked form in three kernels: within each chunk, the state pass over each sequence's chunks,
the outputs) and ``recurrent_pallas.py`` (the decode step over the slot pool, in place). The kernels
also take a gate per key channel (``g [.., H, Dk]``, as KDA). q and k come L2-normalised, q scaled
by ``Dk ** -0.5``; states are float32.
"""

from __future__ import annotations

from jaxinfer.kernels.gated_delta import chunked, chunked_pallas, recurrent_pallas, reference
from jaxinfer.kernels.recurrence import recurrence_ops


gated_delta_rule_op, recurrent_update_op = recurrence_ops(
    "gated_delta", "gated_delta_rule", reference, chunked.gated_delta_rule,
    (chunked_pallas.gated_delta_rule, chunked_pallas.supports), (recurrent_pallas.recurrent_update,
                                                                  recurrent_pallas.supports))


def gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state):
    """q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H]; cu_seqlens [S + 1]; initial_state [S, H, Dk, Dv]
    -> (outputs [T, H, Dv], final states [S, H, Dk, Dv]), float32; see the reference."""
    return gated_delta_rule_op(q, k, v, g, beta, cu_seqlens, initial_state)


def recurrent_step(state, q, k, v, g, beta):
    """One token per head: state [H, Dk, Dv], q/k [H, Dk], v [H, Dv], g/beta [H] -> (output, state)."""
    return reference.recurrent_step(state, q, k, v, g, beta)


def recurrent_update(state_pool, slots, q, k, v, g, beta):
    """One decode token per sequence: state_pool [N, H, Dk, Dv], slots [S] (-1: padding), q/k
    [S, H, Dk], v [S, H, Dv], g/beta [S, H] -> (outputs [S, H, Dv], the updated pool)."""
    return recurrent_update_op(state_pool, slots, q, k, v, g, beta)


__all__ = ["gated_delta_rule", "recurrent_step", "recurrent_update"]
