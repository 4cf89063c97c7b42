"""Gated delta rule ops (gated DeltaNet: Qwen3-Next, Qwen3.5), over packed sequences with state.

``gated_delta_rule`` runs a step's new tokens of several sequences (``cu_seqlens``) from their
initial states and returns the outputs and final states; ``recurrent_step`` advances one token per
sequence (decode). Implementations (``jaxinfer.kernels.registry``): the token-by-token recurrence
(``reference.py``, the truth) and the chunked WY form (``chunked.py``, chunks of 64), the default
everywhere. q and k come L2-normalised, q scaled by ``Dk ** -0.5``; states are float32.
"""

from __future__ import annotations

from jaxinfer.kernels.gated_delta import chunked, reference
from jaxinfer.kernels.registry import Implementation, Op


def _any_call(target, *args, **options) -> bool:
    return True


gated_delta_rule_op = Op("gated_delta.gated_delta_rule", reference.gated_delta_rule, (
    Implementation("chunked", chunked.gated_delta_rule, _any_call, pallas=False),
))
recurrent_step_op = Op("gated_delta.recurrent_step", reference.recurrent_step)


def gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state):
    """q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H]; cu_seqlens [S + 1]; initial_state [S, H, Dk, Dv]
    -> (outputs [T, H, Dv], final states [S, H, Dk, Dv]), float32; see the reference."""
    return gated_delta_rule_op(q, k, v, g, beta, cu_seqlens, initial_state)


def recurrent_step(state, q, k, v, g, beta):
    """One token per head: state [H, Dk, Dv], q/k [H, Dk], v [H, Dv], g/beta [H] -> (output, state)."""
    return recurrent_step_op(state, q, k, v, g, beta)


__all__ = ["gated_delta_rule", "recurrent_step"]
