"""Lightning attention ops (MiniMax-Text-01's linear attention), over packed sequences with state.

``lightning_attention`` runs a step's new tokens of several sequences (``cu_seqlens``) from their
initial states and returns the outputs and final states; ``recurrent_update`` advances one token per
sequence (decode), its state read from and written back to a pool of state slots; ``recurrent_step``
is one token of one sequence. Per head, ``S = exp(-slope) S + k^T v`` and ``o = q S``: q/k/v come
SiLU'd, with no scale and no softmax; ``slope [H]`` is the caller's (from the global layer index);
states are float32. Implementations (``jaxinfer.kernels.registry``): the token-by-token recurrence
(``reference.py``, the truth), the Pallas (Triton lowering) kernels where Pallas runs
(``chunked_pallas.py``: a program per sequence and head walking its chunks; ``recurrent_pallas.py``:
the decode step in place in the pool) and the chunked jnp form (``chunked.py``, chunks of 64)
everywhere else.
"""

from __future__ import annotations

from jaxinfer.kernels.lightning import chunked, chunked_pallas, recurrent_pallas, reference
from jaxinfer.kernels.recurrence import recurrence_ops


lightning_attention_op, recurrent_update_op = recurrence_ops(
    "lightning", "lightning_attention", reference, chunked.lightning_attention,
    (chunked_pallas.lightning_attention, chunked_pallas.supports), (recurrent_pallas.recurrent_update,
                                                                    recurrent_pallas.supports))


def lightning_attention(q, k, v, slope, cu_seqlens, initial_state):
    """q, k [T, H, Dk], v [T, H, Dv], slope [H]; cu_seqlens [S + 1]; initial_state [S, H, Dk, Dv]
    -> (outputs [T, H, Dv], final states [S, H, Dk, Dv]), float32; see the reference."""
    return lightning_attention_op(q, k, v, slope, cu_seqlens, initial_state)


def recurrent_step(state, q, k, v, slope):
    """One token per head: state [H, Dk, Dv], q/k [H, Dk], v [H, Dv], slope [H] -> (output, state)."""
    return reference.recurrent_step(state, q, k, v, slope)


def recurrent_update(state_pool, slots, q, k, v, slope):
    """One decode token per sequence: state_pool [N, H, Dk, Dv], slots [S] (-1: padding), q/k
    [S, H, Dk], v [S, H, Dv], slope [H] -> (outputs [S, H, Dv], the updated pool)."""
    return recurrent_update_op(state_pool, slots, q, k, v, slope)


__all__ = ["lightning_attention", "recurrent_step", "recurrent_update"]
