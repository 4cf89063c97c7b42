"""Linear projections: ``project`` applies one or several ``nn.Linear``-style projections of one input.

It dispatches by platform: the plain-jnp reference (``reference.py``: XLA's matmuls) on CPU. On the
GPU, the Pallas kernel (``skinny_pallas.py``: every projection in one launch, streaming the weights
once) where it measured faster than XLA inside the model (``scripts/profile_step.py`` with and
without ``--reference linear``, H200): several projections of one row, i.e. an attention block's
q/k/v and a gated MLP's gate/up at a batch-1 decode step. Qwen3-30B-A3B's q/k/v took 7.65 us per
layer there against XLA's two kernels' 8.95. At 8 rows XLA's GEMM was as fast (9.9 against 10.2
us), and a single projection stays on XLA, whose matrix-vector kernel was faster on its own
(``scripts/linear_check.py``: 4.3 us against 6.7 for that model's o_proj). Inside that model's
step too: with the router on this kernel the step was 1.4% slower, with the router and the o
projection 3.3% (``scripts/decode_ab.py --variant skinny-router`` / ``skinny-one-row``,
``benchmarks/results/2026-11-30-h200-r3/``).
``set_implementation("reference")`` forces the reference.

``norm_project`` is a pre-norm block's residual add, RMSNorm and first projections (q/k/v, or a
dense MLP's gate/up). At one row with several projections the GPU adds in XLA (which fuses the add
into the kernel that produced the block output) and runs the rest as one launch
(``skinny_pallas.norm_project``): the norm's scale is applied to the outputs, so the weight stream
never waits for it. Otherwise it is the add + norm kernel, then ``project``. On the H200 that took
1.4% off a 24-layer Qwen3-30B-A3B step at B=1 (1.642 against 1.665 ms; about 1 us per layer: q/k/v
8.35 us where the norm and q/k/v took 1.8 + 7.8) and 0.7% off a 16-layer Llama-3-8B step
(``scripts/decode_ab.py --variant unfused-norm-project``, ``benchmarks/results/2026-11-30-h200-r5/``).
The same fold at a MoE block's router (XLA projecting the un-normalised row, the routing kernel
applying the norm) measured no faster there, and is not used; nor is this kernel projecting the
router and writing the normalised row for the experts, 0.2-4% slower in every blocking
(``benchmarks/results/2026-11-30-h200-r8/``).
Rows up to 2048 wide run in one step of 8 weight rows (``skinny_pallas.default_norm_blocking``),
another 1.4% off that step (1.693 against 1.718 ms, ``benchmarks/results/2026-11-30-h200-r6/``).

Tried and not kept: the RMSNorm as this kernel's prologue (every program computing the row's RMS
before streaming its weights). Inside the Qwen3-30B-A3B model at one token it took 9.5 us for the
norm and q/k/v against 1.8 + 7.8 us as two kernels, and 3.5 us for the norm and router against 1.8
+ 1.8. (Timed alone, a projection whose weights fit in L2 runs from L2 on repeated calls: Qwen3's
q/k/v took 5.1 us there against 7.8 in the model, so decode-sized projections are compared inside
the model.)

Also tried: a Mosaic GPU projection that issues the TMA copies of its weight slice first, then waits
for the kernel before it (programmatic dependent launch), then reads x, so that the weight stream
could overlap that kernel. In a chain of 16 o-projection-sized layers on the H200 the kernel alone
ran as fast as XLA's (5.8-6.5 us against 5.9 for 16.8 MB), but PDL did not move the chain's time
beyond noise, and every Mosaic GPU launch cost about 1.4 us more than an XLA kernel's in the chain:
11.8-12.5 us per layer against XLA's 10.5 (``benchmarks/results/2026-11-29-h200-r8/``).
And a projection whose last program to finish (an atomic counter per layer) does the residual add +
RMSNorm: in a 16-layer chain it saved 0.26 us per layer against XLA's matmul + the norm kernel at
hidden 2048 and nothing against this kernel + the norm kernel at 4096
(``benchmarks/results/2026-11-29-h200-r9/``).
"""

from __future__ import annotations

from jaxinfer.kernels import norm as norm_ops
from jaxinfer.kernels.dispatch import OpDispatcher
from jaxinfer.kernels.linear import reference, skinny_pallas


def _project_where_faster(x, weights, biases=None, *, interpret: bool = False):
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if len(weights) > 1 and rows == 1:
        return skinny_pallas.project(x, weights, biases, interpret=interpret)
    return reference.project(x, weights, biases)


def _norm_project_where_faster(x, residual, norm_weight, weights, biases=None, *, eps: float,
                               unit_offset: bool = False, float32_weight: bool = False, interpret: bool = False):
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if len(weights) > 1 and rows == 1:
        summed = x if residual is None else x + residual
        return skinny_pallas.norm_project(summed, norm_weight, weights, biases, eps=eps, unit_offset=unit_offset,
                                          interpret=interpret), summed
    normed, summed = norm_ops.add_rms_norm(x, residual, norm_weight, eps, unit_offset=unit_offset,
                                           float32_weight=float32_weight)
    return project(normed, weights, biases), summed


_dispatch = OpDispatcher(
    "linear",
    {"reference": {"project": reference.project, "norm_project": reference.norm_project},
     "pallas": {"project": _project_where_faster, "norm_project": _norm_project_where_faster}},
    {"gpu": "pallas", "cuda": "pallas"},
)
set_implementation = _dispatch.set_implementation
implementation_name = _dispatch.implementation_name


def project(x, weights, biases=None, **options):
    """x [..., K], weights ``[N_i, K]``, biases ``[N_i]`` or None -> tuple of [..., N_i]; see the reference."""
    return _dispatch("project")(x, tuple(weights), None if biases is None else tuple(biases), **options)


def norm_project(x, residual, norm_weight, weights, biases=None, *, eps: float, unit_offset: bool = False,
                 float32_weight: bool = False, **options):
    """-> (projections of ``rms_norm(x + residual)``, ``x + residual``); see the reference."""
    return _dispatch("norm_project")(x, residual, norm_weight, tuple(weights),
                                     None if biases is None else tuple(biases), eps=eps, unit_offset=unit_offset,
                                     float32_weight=float32_weight, **options)


__all__ = ["implementation_name", "norm_project", "project", "set_implementation"]
