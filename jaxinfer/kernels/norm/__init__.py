"""Normalisation ops: RMSNorm with an optional residual add before it.

``add_rms_norm``: the plain-jnp reference (``reference.py``), or the Pallas kernel
(``rms_norm_pallas.py``: the add and the norm in one launch) wherever Pallas kernels run (faster
than XLA's fusion inside a decode step: docs/performance.md, "RMSNorm"). Implementations are chosen
by ``jaxinfer.kernels.registry``.
"""

from __future__ import annotations

from jaxinfer.kernels.norm import reference, rms_norm_pallas
from jaxinfer.kernels.registry import Implementation, Op, where_pallas_runs


def _one_dtype(x, residual, *args, **options) -> bool:
    return residual is None or residual.dtype == x.dtype


add_rms_norm_op = Op("norm.add_rms_norm", reference.add_rms_norm,
                     (Implementation("pallas", rms_norm_pallas.add_rms_norm, where_pallas_runs(_one_dtype)),))


def add_rms_norm(x, residual, weight, eps: float, **options):
    """-> (rms_norm(x + residual) * weight, x + residual); see the reference."""
    return add_rms_norm_op(x, residual, weight, eps, **options)


__all__ = ["add_rms_norm"]
