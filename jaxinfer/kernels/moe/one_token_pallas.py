"""The expert MLP of one token (a decode step at batch 1) as matrix-vector kernels in Pallas (Triton
lowering); same semantics as ``grouped_pallas.moe_mlp`` at one token, and so as ``reference.moe_mlp``.

At one token the expert MLP is ``k`` matrix-vector products per projection, and its whole cost is
reading the touched experts' weights once. The grouped GEMM runs them as 16-row tensor-core tiles with
one real row. Here the products run on the CUDA cores, as in the few-row projection
(``linear/skinny_pallas.py``): elementwise in float32 over ``[block_n, block_k]`` weight tiles, reduced
once at the end. Thin column blocks then give every SM many programs, each with long contiguous reads.

- **gate + up + activation**: grid ``(I blocks, k slots)``. A program reads ``block_n`` rows of its
  slot's expert's ``gate`` and ``up``, walking ``H``, applies the gated activation in float32 and writes
  its tile of the hidden ``[k, I]``, rounded once to ``x``'s dtype.
- **down**: grid ``(H blocks,)``. A program walks the ``k`` slots. For each it reads ``block_n`` rows of
  that expert's ``down`` (walking ``I``) against the slot's hidden row, adds the bias, scales by the
  routing weight (rounded to ``x``'s dtype) and rounds the row to ``x``'s dtype, as the grouped kernel
  writes it. It sums the slots in float32 on the way, so the sum needs no launch of its own.
  ``sum_slots=False`` instead gives each slot its own programs (grid ``(H blocks, k)``) and sums the
  slots in XLA, as the grouped path does.

Every rounding matches the grouped kernel's; only the order of the float32 sums differs.

An earlier one-token down kernel that summed the slots took 16 columns a program: 128 programs at
Qwen3-30B-A3B's shape, too few, and it lost to the grouped kernel (``grouped_pallas.py``'s notes).
Here 4 columns a program give 512. ``sum_slots=False`` keeps the separate sum, for comparison.
The dispatcher does not take these kernels yet: they have not been timed on the GPU
(``scripts/moe_check.py --only-one-token``, ``scripts/decode_ab.py --variant one-token-moe``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.kernels.moe.reference import gated_activation


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class Blocking(NamedTuple):
    block_n: int  # weight rows (output columns) per program
    block_k: int  # reduction step
    num_warps: int = 4
    num_stages: int = 3


def default_blocking(hidden: int, inter: int) -> tuple[Blocking, Blocking]:
    """(gate + up, down): 4 weight rows a program, reduction steps of up to 1024 columns (masked past
    the dimension), the few-row projection's blocking at one row."""
    return (Blocking(4, min(1024, max(16, _next_pow2(hidden)))),
            Blocking(4, min(1024, max(16, _next_pow2(inter)))))


def _check_blocking(name: str, blocking: Blocking):
    for field in ("block_n", "block_k"):
        value = getattr(blocking, field)
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} {field} ({value}) must be a power of two")


def _weight_rows(ref, e, n0, k0, block_n: int, block_k: int):
    """``ref[e, n0:n0+block_n, k0:k0+block_k]``, zero past the matrix's edges (the indices are clamped
    as well, so that interpret mode never reads out of bounds)."""
    n_size, k_size = ref.shape[1:]
    rows = n0 + lax.broadcasted_iota(jnp.int32, (block_n, block_k), 0)
    cols = k0 + lax.broadcasted_iota(jnp.int32, (block_n, block_k), 1)
    if n_size % block_n == 0 and k_size % block_k == 0:
        return ref[e, pl.ds(n0, block_n), pl.ds(k0, block_k)]
    mask = (rows < n_size) & (cols < k_size)
    return plgpu.load(ref.at[e, jnp.minimum(rows, n_size - 1), jnp.minimum(cols, k_size - 1)], mask=mask, other=0.0)


def _vector(ref, index, k0, block_k: int, size: int):
    """``ref[index, k0:k0+block_k]`` of a 2-D ``ref`` in float32, zero past ``size``."""
    cols = k0 + jnp.arange(block_k, dtype=jnp.int32)
    if size % block_k == 0:
        return ref[index, pl.ds(k0, block_k)].astype(jnp.float32)
    return plgpu.load(ref.at[index, jnp.minimum(cols, size - 1)], mask=cols < size, other=0.0).astype(jnp.float32)


def _bias(ref, e, n0, block_n: int, dtype):
    """Bias slice ``ref[e, n0:n0+block_n]``, rounded to ``dtype`` as the reference adds it, in float32."""
    size = ref.shape[1]
    cols = n0 + jnp.arange(block_n, dtype=jnp.int32)
    b = plgpu.load(ref.at[e, jnp.minimum(cols, size - 1)], mask=cols < size, other=0.0)
    return b.astype(dtype).astype(jnp.float32)


def _matvecs(w_refs, e, n0, vector, *, block_n: int, block_k: int, dtype):
    """``w[e, n0:n0+block_n, :] @ v`` in float32 for each ``w`` of ``w_refs`` (one loop: their loads
    in flight together), ``vector(k0)`` giving v's float32 slice at ``k0``."""
    k_size = w_refs[0].shape[2]

    def body(kb, accs):
        k0 = kb * block_k
        v = vector(k0)[None, :]
        # Each weight rounded to x's dtype first, as the grouped kernel does.
        return tuple(acc + _weight_rows(w_ref, e, n0, k0, block_n, block_k).astype(dtype).astype(jnp.float32) * v
                     for acc, w_ref in zip(accs, w_refs))

    zeros = tuple(jnp.zeros((block_n, block_k), jnp.float32) for _ in w_refs)
    return tuple(acc.sum(axis=1) for acc in lax.fori_loop(0, pl.cdiv(k_size, block_k), body, zeros))


def _gate_up_kernel(ids_ref, x_ref, gate_ref, up_ref, *rest, has_bias: bool, activation: str, alpha: float,
                    limit: float, block_k: int):
    if has_bias:
        gate_bias_ref, up_bias_ref, h_ref = rest
    else:
        (h_ref,) = rest
    (block_n,) = h_ref.shape
    dtype = x_ref.dtype
    hidden = x_ref.shape[1]
    e = ids_ref[0]
    n0 = pl.program_id(0) * block_n

    g, u = _matvecs((gate_ref, up_ref), e, n0, lambda k0: _vector(x_ref, 0, k0, block_k, hidden), block_n=block_n,
                    block_k=block_k, dtype=dtype)
    if has_bias:
        g += _bias(gate_bias_ref, e, n0, block_n, dtype)
        u += _bias(up_bias_ref, e, n0, block_n, dtype)
    h_ref[...] = gated_activation(g, u, activation, alpha, limit).astype(h_ref.dtype)


def _down_slot(j, ids_ref, weight_ref, h_ref, down_ref, bias_ref, n0, *, block_n: int, block_k: int, dtype):
    """Slot ``j``'s weighted down-projection rows ``n0:n0+block_n``, rounded to ``dtype``, in float32."""
    e = ids_ref[j]
    inter = down_ref.shape[2]
    (y,) = _matvecs((down_ref,), e, n0, lambda k0: _vector(h_ref, j, k0, block_k, inter), block_n=block_n,
                    block_k=block_k, dtype=dtype)
    if bias_ref is not None:
        y += _bias(bias_ref, e, n0, block_n, dtype)
    y *= weight_ref[j].astype(dtype).astype(jnp.float32)
    return y.astype(dtype).astype(jnp.float32)


def _down_kernel(ids_ref, weight_ref, h_ref, down_ref, *rest, has_bias: bool, sum_slots: bool, block_k: int):
    bias_ref, o_ref = rest if has_bias else (None, *rest)
    block_n = o_ref.shape[-1]
    options = dict(block_n=block_n, block_k=block_k, dtype=o_ref.dtype)
    n0 = pl.program_id(0) * block_n
    if sum_slots:  # every slot, summed in float32 in slot order
        total = jnp.zeros((block_n,), jnp.float32)
        for j in range(h_ref.shape[0]):
            total += _down_slot(j, ids_ref, weight_ref, h_ref, down_ref, bias_ref, n0, **options)
        o_ref[...] = total.astype(o_ref.dtype)
    else:
        j = pl.program_id(1)
        o_ref[...] = _down_slot(j, ids_ref, weight_ref, h_ref, down_ref, bias_ref, n0, **options).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("activation", "alpha", "limit", "gate_up_blocking", "down_blocking",
                                             "sum_slots", "interpret"))
def moe_mlp(x, expert_ids, expert_weights, gate, up, down, *, gate_bias=None, up_bias=None, down_bias=None,
            activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
            gate_up_blocking: Blocking | None = None, down_blocking: Blocking | None = None, sum_slots: bool = True,
            interpret: bool = False):
    """``grouped_pallas.moe_mlp`` for one token: x [1, H]; expert_ids [1, k] int; expert_weights [1, k]
    -> [1, H] in x's dtype. Weights in nn.Linear layout (``gate``/``up`` [E, I, H], ``down`` [E, H, I]),
    optional biases [E, I], [E, I], [E, H]; expert ids must lie in ``[0, E)``. ``gate_up_blocking`` /
    ``down_blocking`` override ``default_blocking``; ``sum_slots`` is explained in the module."""
    if activation not in ("silu", "gpt_oss"):
        raise ValueError(f"unknown MoE activation {activation!r}")
    if x.ndim != 2 or x.shape[0] != 1:
        raise ValueError(f"the one-token MoE kernel takes x of shape [1, H], not {x.shape}")
    hidden = x.shape[1]
    num_experts, inter, hidden_w = gate.shape
    top_k = expert_ids.shape[-1]
    if expert_ids.shape != (1, top_k) or expert_weights.shape != (1, top_k):
        raise ValueError(f"expert_ids {expert_ids.shape} / expert_weights {expert_weights.shape} must be [1, k]")
    if hidden_w != hidden or up.shape != gate.shape or down.shape != (num_experts, hidden, inter):
        raise ValueError(f"expert weights gate {gate.shape}, up {up.shape}, down {down.shape} do not match "
                         f"[E, I, H] / [E, H, I] with H = {hidden}")
    for name, b, n in (("gate_bias", gate_bias, inter), ("up_bias", up_bias, inter), ("down_bias", down_bias, hidden)):
        if b is not None and b.shape != (num_experts, n):
            raise ValueError(f"{name} {b.shape} must be [{num_experts}, {n}]")
    default_gate_up, default_down = default_blocking(hidden, inter)
    gu, dn = gate_up_blocking or default_gate_up, down_blocking or default_down
    _check_blocking("gate_up_blocking", gu)
    _check_blocking("down_blocking", dn)
    ids = expert_ids.reshape(top_k).astype(jnp.int32)
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731  (indexed in the kernel)

    # gate + up + activation: hidden [k, I] (the columns past I of the last block are dropped).
    has_bias = gate_bias is not None or up_bias is not None
    inputs = [ids.reshape(top_k, 1), x, gate, up]
    in_specs = [pl.BlockSpec((None, 1), lambda n, j: (j, 0)), whole(x), whole(gate), whole(up)]
    if has_bias:
        zeros = jnp.zeros((num_experts, inter), x.dtype)
        inputs += [zeros if gate_bias is None else gate_bias, zeros if up_bias is None else up_bias]
        in_specs += [whole(zeros)] * 2
    inter_blocks = pl.cdiv(inter, gu.block_n)
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, has_bias=has_bias, activation=activation, alpha=float(alpha),
                          limit=float(limit), block_k=gu.block_k),
        grid=(inter_blocks, top_k),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, gu.block_n), lambda n, j: (j, n)),
        out_shape=jax.ShapeDtypeStruct((top_k, inter_blocks * gu.block_n), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=gu.num_warps, num_stages=gu.num_stages),
        interpret=interpret,
        name=f"moe_one_token_gate_up_block_n={gu.block_n}_block_k={gu.block_k}",
    )(*inputs)
    h = h[:, :inter]

    # down (+ the slot sum): [H] or [k, H].
    weights = expert_weights.reshape(top_k)
    inputs = [ids, weights, h, down] + ([down_bias] if down_bias is not None else [])
    hidden_blocks = pl.cdiv(hidden, dn.block_n)
    if sum_slots:
        grid, out_spec = (hidden_blocks,), pl.BlockSpec((dn.block_n,), lambda n: (n,))
        out_shape = jax.ShapeDtypeStruct((hidden_blocks * dn.block_n,), x.dtype)
    else:
        grid, out_spec = (hidden_blocks, top_k), pl.BlockSpec((None, dn.block_n), lambda n, j: (j, n))
        out_shape = jax.ShapeDtypeStruct((top_k, hidden_blocks * dn.block_n), x.dtype)
    out = pl.pallas_call(
        functools.partial(_down_kernel, has_bias=down_bias is not None, sum_slots=sum_slots, block_k=dn.block_k),
        grid=grid,
        in_specs=[whole(a) for a in inputs],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=dn.num_warps, num_stages=dn.num_stages),
        interpret=interpret,
        name=f"moe_one_token_down_block_n={dn.block_n}_block_k={dn.block_k}{'_summed' if sum_slots else ''}",
    )(*inputs)
    if not sum_slots:  # the grouped path's combine: the k rows summed in float32
        out = out.astype(jnp.float32).sum(axis=0).astype(x.dtype)
    return out[:hidden].reshape(1, hidden)


__all__ = ["Blocking", "default_blocking", "moe_mlp"]
