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

Tried and not kept: the block's residual add + RMSNorm as this kernel's prologue (every program
computing the row's RMS before streaming its weights, one launch less). Inside the Qwen3-30B-A3B
model at one token it took 9.5 us for the norm and q/k/v against 1.8 + 7.8 us as two kernels, and
3.5 us for the norm and router against 1.8 + 1.8. (Timed alone, a projection whose weights fit in
L2 runs from L2 on repeated calls: Qwen3's q/k/v took 5.1 us there against 7.8 in the model, so
decode-sized projections are compared inside the model.)

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

from jaxinfer.kernels.dispatch import OpDispatcher
from jaxinfer.kernels.linear import reference, skinny_pallas


def _project_where_faster(x, weights, biases=None, *, interpret: bool = False):
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if len(weights) > 1 and rows == 1:
        return skinny_pallas.project(x, weights, biases, interpret=interpret)
    return reference.project(x, weights, biases)


_dispatch = OpDispatcher(
    "linear",
    {"reference": {"project": reference.project}, "pallas": {"project": _project_where_faster}},
    {"gpu": "pallas", "cuda": "pallas"},
)
set_implementation = _dispatch.set_implementation
implementation_name = _dispatch.implementation_name


def project(x, weights, biases=None, **options):
    """x [..., K], weights ``[N_i, K]``, biases ``[N_i]`` or None -> tuple of [..., N_i]; see the reference."""
    return _dispatch("project")(x, tuple(weights), None if biases is None else tuple(biases), **options)


__all__ = ["implementation_name", "project", "set_implementation"]
