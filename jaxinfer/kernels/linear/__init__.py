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

fp8 weights (``jaxinfer.quantization.Fp8Weight``) pass through both ops as stored. Wherever Pallas runs
and the rows fit, the few-row kernel takes every call with one: it reads the fp8 bytes and dequantizes
in registers, where XLA would first write a dequantized copy of the weight at every step (so it is
taken without a GPU measurement). More rows run the reference: dequantize, then XLA's matmul.

``fp8_gemm`` (``linear.fp8_gemm``) is an fp8 x fp8 GEMM, x quantized per token and column group: not
the checkpoint's semantics (it adds x's quantization error), so ``project`` uses it only inside
``quantized_activations()``, for fp8 weights at more than ``skinny_pallas.MAX_ROWS`` rows. Its Pallas
kernel is not preferred (not yet measured on a GPU): ``registry.force("linear.fp8_gemm", "triton")``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

from jaxinfer.kernels import norm as norm_ops
from jaxinfer.kernels import registry
from jaxinfer.kernels.linear import fp8, fp8_gemm_pallas, reference, skinny_pallas
from jaxinfer.kernels.registry import Implementation, Op, where_pallas_runs


def _rows(x) -> int:
    return x.size // x.shape[-1] if x.shape[-1] else 0


def _few_rows(x, weights, biases=None, **options) -> bool:
    return x.shape[-1] > 0 and 0 < _rows(x) <= skinny_pallas.MAX_ROWS and skinny_pallas.takes_weights(weights)


def _several_of_one_row(x, weights, *args, **options) -> bool:
    return len(weights) > 1 and _rows(x) == 1


def _skinny_preferred(x, weights) -> bool:
    """Several projections of one row (measured), or any fp8 weight (read as stored, not copied)."""
    return _several_of_one_row(x, weights) or fp8.any_fp8(weights)


def _one_row_norm(x, residual, norm_weight, weights, biases=None, *, float32_weight: bool = False, **options):
    return x.shape[-1] > 0 and _rows(x) == 1 and not float32_weight and skinny_pallas.takes_weights(weights)


def _gemm_takes(x, weight, bias=None, **options) -> bool:
    return x.shape[-1] > 0 and _rows(x) > 0 and fp8_gemm_pallas.takes(weight)


def _never(target, *args, **options) -> bool:
    return False


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


def _reads_weights(check, weights_at: int):
    """A kernel's ``supports``: ``where_pallas_runs(check)``, and fp8 weights (the call's argument
    ``weights_at``: a weight or a sequence of them) only where Pallas reads e4m3
    (``Target.reads_float8``)."""
    pallas = where_pallas_runs(check)

    def supports(target, *args, **options) -> bool:
        weights = args[weights_at]
        quantized = fp8.is_fp8(weights) or (isinstance(weights, (tuple, list)) and fp8.any_fp8(weights))
        return pallas(target, *args, **options) and (target.reads_float8 or not quantized)
    return supports


project_op = Op("linear.project", reference.project, (
    Implementation("skinny", skinny_pallas.project, _reads_weights(_few_rows, 1),
                   preferred=lambda t, *a, **o: _skinny_preferred(a[0], a[1])),
))
norm_project_op = Op("linear.norm_project", reference.norm_project, (
    Implementation("skinny", _skinny_norm_project, _reads_weights(_one_row_norm, 3),
                   preferred=lambda t, *a, **o: _skinny_preferred(a[0], a[3])),
    Implementation("ops", _norm_then_project, where_pallas_runs(), pallas=False),
))
fp8_gemm_op = Op("linear.fp8_gemm", reference.fp8_gemm, (
    Implementation("triton", fp8_gemm_pallas.fp8_gemm, _reads_weights(_gemm_takes, 1), preferred=_never),
))


def project(x, weights, biases=None, **options):
    """x [..., K], weights ``[N_i, K]``, biases ``[N_i]`` or None -> tuple of [..., N_i]; see the reference."""
    return project_op(x, tuple(weights), None if biases is None else tuple(biases), **options)


def norm_project(x, residual, norm_weight, weights, biases=None, *, eps: float, unit_offset: bool = False,
                 float32_weight: bool = False, **options):
    """-> (projections of ``rms_norm(x + residual)``, ``x + residual``); see the reference."""
    return norm_project_op(x, residual, norm_weight, tuple(weights), None if biases is None else tuple(biases),
                           eps=eps, unit_offset=unit_offset, float32_weight=float32_weight, **options)


def fp8_gemm(x, weight, bias=None, **options):
    """x [..., K] times an fp8 ``weight`` [N, K] with x quantized to fp8 -> [..., N]; see the reference."""
    return fp8_gemm_op(x, weight, bias, **options)


def project_quantizing_activations(x, weights, biases=None):
    """``linear.project`` as ``quantized_activations()`` serves it: at more than
    ``skinny_pallas.MAX_ROWS`` rows each fp8 weight through ``fp8_gemm``; the other projections (and
    every one at fewer rows) as ``linear.project`` serves them otherwise."""
    weights = tuple(weights)
    biases = (None,) * len(weights) if biases is None else tuple(biases)
    reference.check_projections(x, weights, biases)
    quantized = [fp8.is_fp8(w) and _rows(x) > skinny_pallas.MAX_ROWS for w in weights]
    rest = [i for i, q in enumerate(quantized) if not q]
    chosen = registry.selection()
    plain = dataclasses.replace(chosen, variants=tuple(v for v in chosen.variants if v[0] != project_op.name))
    outputs = {}
    if rest:
        with registry.applied(plain):
            outputs.update(zip(rest, project(x, [weights[i] for i in rest], [biases[i] for i in rest])))
    for i, q in enumerate(quantized):
        if q:
            outputs[i] = fp8_gemm(x, weights[i], biases[i])
    return tuple(outputs[i] for i in range(len(weights)))


@contextlib.contextmanager
def quantized_activations() -> Iterator[None]:
    """Inside, ``project`` (and ``norm_project`` where it runs the add + norm op, then ``project``)
    applies fp8 weights at more than
    ``skinny_pallas.MAX_ROWS`` rows (prefill) as fp8 x fp8 GEMMs (``fp8_gemm``), trading x's fp8
    quantization error for the fp8 tensor cores. It is a registry variant of ``linear.project``, so
    an engine created inside keeps it for every program it compiles (its kernel selection holds it)."""
    with registry.variant(project_op.name, project_quantizing_activations, pallas=False):
        yield


__all__ = ["fp8_gemm", "norm_project", "project", "project_quantizing_activations", "quantized_activations"]
