"""Linear projections: ``project`` applies one or several ``nn.Linear``-style projections of one
input; ``norm_project`` is a pre-norm block's residual add, RMSNorm and first projections.

Implementations (chosen by ``jaxinfer.kernels.registry``): the plain-jnp reference
(``reference.py``: XLA's matmuls), and the few-row Pallas kernel (``skinny_pallas.py``: every
projection in one launch, streaming the weights once). The kernel is preferred where it measured
faster than XLA inside a model step: several projections of one row (an attention block's q/k/v, a
gated MLP's gate/up at a batch-1 decode step). A single projection, or more rows, stays XLA's,
which was as fast or faster there. ``norm_project`` at one row does the add in XLA (fused into the
kernel that produced the block output) and the norm inside the projection kernel (its scale applied
to the outputs, so the weight stream never waits for it); elsewhere it is the add + norm op, then
``project``. The measurements: docs/performance.md, "Projections".
"""

from __future__ import annotations

from jaxinfer.kernels import norm as norm_ops
from jaxinfer.kernels.linear import reference, skinny_pallas
from jaxinfer.kernels.registry import Implementation, Op, where_pallas_runs


def _rows(x) -> int:
    return x.size // x.shape[-1] if x.shape[-1] else 0


def _few_rows(x, weights, biases=None, **options) -> bool:
    return x.shape[-1] > 0 and 0 < _rows(x) <= skinny_pallas.MAX_ROWS


def _several_of_one_row(x, weights, *args, **options) -> bool:
    return len(weights) > 1 and _rows(x) == 1


def _one_row_norm(x, residual, norm_weight, weights, biases=None, *, float32_weight: bool = False, **options):
    return x.shape[-1] > 0 and _rows(x) == 1 and not float32_weight


def _skinny_norm_project(x, residual, norm_weight, weights, biases=None, *, eps: float, unit_offset: bool = False,
                         float32_weight: bool = False, interpret: bool = False, **tuning):
    summed = x if residual is None else x + residual
    return skinny_pallas.norm_project(summed, norm_weight, weights, biases, eps=eps, unit_offset=unit_offset,
                                      interpret=interpret, **tuning), summed


def _norm_then_project(x, residual, norm_weight, weights, biases=None, *, eps: float, unit_offset: bool = False,
                       float32_weight: bool = False):
    normed, summed = norm_ops.add_rms_norm(x, residual, norm_weight, eps, unit_offset=unit_offset,
                                           float32_weight=float32_weight)
    return project(normed, weights, biases), summed


project_op = Op("linear.project", reference.project, (
    Implementation("skinny", skinny_pallas.project, where_pallas_runs(_few_rows), preferred=lambda t, *a, **o:
                   _several_of_one_row(*a, **o)),
))
norm_project_op = Op("linear.norm_project", reference.norm_project, (
    Implementation("skinny", _skinny_norm_project, where_pallas_runs(_one_row_norm),
                   preferred=lambda t, *a, **o: _several_of_one_row(a[0], a[3])),
    Implementation("ops", _norm_then_project, where_pallas_runs(), pallas=False),
))


def project(x, weights, biases=None, **options):
    """x [..., K], weights ``[N_i, K]``, biases ``[N_i]`` or None -> tuple of [..., N_i]; see the reference."""
    return project_op(x, tuple(weights), None if biases is None else tuple(biases), **options)


def norm_project(x, residual, norm_weight, weights, biases=None, *, eps: float, unit_offset: bool = False,
                 float32_weight: bool = False, **options):
    """-> (projections of ``rms_norm(x + residual)``, ``x + residual``); see the reference."""
    return norm_project_op(x, residual, norm_weight, tuple(weights), None if biases is None else tuple(biases),
                           eps=eps, unit_offset=unit_offset, float32_weight=float32_weight, **options)


__all__ = ["norm_project", "project"]
