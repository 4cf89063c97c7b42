"""Linear projections in plain jnp: the semantic truth for the kernel.

``project`` applies several projections of one input at once (e.g. an attention block's q, k and v),
each exactly as ``nn.Linear`` does in HF: ``x @ weight.T`` in x's dtype, then the bias added in that
dtype. Weights keep the checkpoint's ``[out_features, in_features]`` layout. ``norm_project`` is a
pre-norm block's residual add and RMSNorm followed by its first projections.
"""

from __future__ import annotations

import jax

from jaxinfer.kernels.norm.reference import add_rms_norm


def check_projections(x, weights, biases) -> None:
    if biases is not None and len(biases) != len(weights):
        raise ValueError(f"{len(weights)} weights but {len(biases)} biases (give None for a projection without one)")
    for i, w in enumerate(weights):
        if w.ndim != 2 or w.shape[1] != x.shape[-1]:
            raise ValueError(f"weight {i} is {w.shape}; it must be [out_features, {x.shape[-1]}] for x {x.shape}")
        b = None if biases is None else biases[i]
        if b is not None and b.shape != (w.shape[0],):
            raise ValueError(f"bias {i} is {b.shape}; it must be [{w.shape[0]}]")


def project(x, weights, biases=None):
    """x [..., K]; weights: a sequence of [N_i, K]; biases: None or a sequence of [N_i] or None ->
    a tuple of [..., N_i] in x's dtype."""
    check_projections(x, weights, biases)
    outputs = []
    for i, w in enumerate(weights):
        y = jax.lax.dot_general(x, w.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())))
        b = None if biases is None else biases[i]
        outputs.append(y if b is None else y + b.astype(y.dtype))
    return tuple(outputs)


def norm_project(x, residual, norm_weight, weights, biases=None, *, eps: float, unit_offset: bool = False,
                 float32_weight: bool = False):
    """``normed, summed = add_rms_norm(x, residual, norm_weight, eps, ...)`` (``residual=None``: ``x``
    alone), then ``(project(normed, weights, biases), summed)``: the projections and the residual
    stream after the add."""
    normed, summed = add_rms_norm(x, residual, norm_weight, eps, unit_offset=unit_offset,
                                  float32_weight=float32_weight)
    return project(normed, weights, biases), summed
