"""Mixture-of-experts MLP as two grouped GEMMs in Pallas (Triton lowering), same semantics as ``reference.py``.

**Grouping** (``grouping.py``). The ``N = T * k`` (token, slot) assignments are sorted by expert
(stably) and each expert's group is padded up to a multiple of ``block_m`` rows (*block-aligned
padding*), so every *row block* of ``block_m`` consecutive padded rows belongs to one expert. The
grouping keeps, per padded row, the (token, slot) pair it holds (-1 for padding), per row block its
expert (-1 for blocks past the last used one), and per pair the padded row it went to (for the
combine). An expert with ``n`` rows takes ``cdiv(n, block_m)`` blocks, so there are at most
``(N + min(E, N) * (block_m - 1)) // block_m`` row blocks in use (at most ``cdiv(N, block_m) + E``):
that static bound is the grid size, and the unused blocks at its end return at once. Prefill groups
with two Pallas launches (``grouping_pallas.py``); decode with the sort-free forms of ``grouping.py``.

**Kernel A, gate + up + activation**: grid ``(I blocks, row blocks)``. A program reads its block's
``block_m`` pairs (token = pair // k), gathers those rows of ``x`` straight from ``[T, H]``
(pointer arithmetic from the index vector: no gathered copy of ``x`` is materialised; padding rows
are masked, never loaded), and multiplies them by the ``[block_n, block_k]`` tiles of its expert's
``gate`` and ``up`` (nn.Linear layout, so ``dot(x, w, trans_b=True)``), walking ``H`` ``block_k`` at
a time with two float32 accumulators. It adds the biases, applies the gated activation in float32
and writes the hidden tile, in ``x``'s dtype, to ``[rows, I_pad]``.

**Kernel B, down projection**: grid ``(H blocks, row blocks)``. A program multiplies its block's hidden
rows by its expert's ``[block_n, block_k]`` tiles of ``down`` (walking ``I``), adds the bias, scales
every row by its routing weight (gathered by the row's (token, slot) index, rounded to ``x``'s dtype;
0 on padding rows) and writes ``[rows, H_pad]`` in ``x``'s dtype.

**Quantized experts** (``expert_tiles.py``). ``gate``/``up``/``down`` may be ``Fp8Weight`` or
``Mxfp4Weight`` as loaded: both kernels read their stored bytes and scales and dequantize each weight
tile in registers (a ``K`` step inside one fp8 scale column, or whole MXFP4 groups, the packed nibbles
as two half-width operands against the even and odd columns of ``x`` / the hidden), so no
dequantized copy of the experts is ever written. gate and up are stored alike; down may differ.

**Combine** (jnp): each (token, slot) gathers its padded row; the ``k`` slots are summed in float32.
Only real rows are ever read, so padding rows and unused blocks (never written) cannot leak in.

**Dropped pairs.** An expert id outside ``[0, E)`` (expert parallelism: another device's expert)
takes no row and makes no block (``grouping.py``), so nothing is computed for it; its slot is a zero
in the combine (selected, not multiplied: an unwritten row cannot leak in).

The grid's first (fastest) axis is the output-column block: the programs running together share one
row block (its ``x`` rows / hidden rows are read from HBM once and then hit L2) and consecutive row
blocks of one expert reuse that expert's weight tiles from L2.

**Ragged sizes.** Blocks are powers of two >= 16 (``dot`` needs >= 16). The default ``block_k`` is the
largest power of two (up to the Hopper target) that divides the reduction dimension (2880 = 45 * 64
takes 64, 768 and 2048 take the targets), so the reductions of the real models run unmasked; the
output-column ``block_n`` keeps its target where that pads the dimension by at most 1/8 (2880 -> 23 x
128 columns for gate and up, 12 x 256 for down), which measured faster than narrower unmasked tiles
(docs/performance.md, "MoE grouped GEMM kernels").
Past ``H``/``I`` the weight, bias and ``x`` loads are masked to zero and the two intermediate arrays
are padded (``I_pad``, ``H_pad``: whole blocks; the hidden's padding columns are written as zeros).

**Decode** (``T * k <= 128``): ``block_m = clip(next_pow2(T), 16, 128)``. An expert gets at most ``T``
rows (top-k picks distinct experts: one row per token that chose it), so every touched expert has
exactly one row block, and its weights are read exactly once: each ``(I block, row block)`` /
``(H block, row block)`` program reads its expert's tile once, and the tiles of one expert are disjoint
across the column grid. Untouched experts have no row block, so their weights are never read. That
weight traffic is the whole decode cost, and narrow ``block_n`` (32 for gate and up, 64 for down)
spread it over enough programs to fill the GPU. **Prefill**:
``block_m = clip(next_pow2(2 * N / E), 16, 128)``, about twice the mean expert load: small enough that
padding stays cheap, large enough that most experts still take one block (weights read about once)
and big loads get 128-row MMA tiles.

The one-token variants tried and not kept (the slot sum inside the down kernel, routing inside the
gate + up kernel, matrix-vector kernels on the CUDA cores, an L2 prefetch of the down weights, the
MoE block's RMSNorm applied in the gate + up kernel) are in docs/performance.md, "MoE grouped GEMM
kernels".
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.kernels import pdl
from jaxinfer.kernels.moe import expert_tiles, grouping_pallas
from jaxinfer.kernels.moe.grouping import group_few_by_expert, group_one_token
from jaxinfer.kernels.moe.reference import ACTIVATIONS, gated_activation

DECODE_ROWS = 128  # T * k at or below this is decode-sized: one row block per touched expert


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _fit(dim: int, target: int, pad_ok: bool = False) -> int:
    """``target`` where it divides ``dim`` (or, with ``pad_ok``, pads it by at most 1/8: masked output
    columns measured cheaper than narrower tiles, docs/performance.md, "MoE grouped GEMM kernels");
    else the largest power of two in [16, target] dividing ``dim``; else ``target`` (capped to the
    dimension), masked."""
    cap = min(target, max(16, _next_pow2(dim)))
    if dim % cap == 0 or (pad_ok and _round_up(dim, cap) <= 1.125 * dim):
        return cap
    b = cap
    while b > 16 and dim % b:
        b //= 2
    return b if dim % b == 0 else cap


def default_block_sizes(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int) -> dict:
    """Block sizes and launch parameters for one call (aimed at Hopper / H200).

    Returns ``block_m`` and, per kernel (``"gate_up"``, ``"down"``), ``block_n``, ``block_k``,
    ``num_warps``, ``num_stages``. Decode-sized (``block_m <= 32``, memory bound): narrow column blocks
    (32; 64 for down, measured faster than 32: docs/performance.md, "MoE grouped GEMM kernels") for many
    programs, long ``block_k`` (128) for wide contiguous weight loads, 4 warps, 4 stages (3 for down
    from 2 tokens on).
    Prefill (``block_m`` 64 / 128, compute bound): at 64 rows, 64 (gate and up: two accumulators) or
    128 (down) columns, 4 warps, 4 stages; at 128 rows, 128 or 256 columns, 8 warps, 4 stages;
    ``block_k`` 64.
    """
    rows = num_tokens * top_k
    if rows <= DECODE_ROWS:
        block_m = min(128, max(16, _next_pow2(num_tokens)))
    else:
        block_m = min(128, max(16, _next_pow2(2 * -(-rows // num_experts))))
    if block_m <= 32:
        gate_up = dict(block_n=32, block_k=128, num_warps=4, num_stages=4)
        # Down in 3 stages from 2 tokens on, 4 at one token, as measured on the H200:
        # docs/performance.md, "MoE grouped GEMM kernels".
        down = dict(block_n=64, block_k=128, num_warps=4, num_stages=3 if num_tokens > 1 else 4)
    elif block_m == 64:
        gate_up = dict(block_n=64, block_k=64, num_warps=4, num_stages=4)
        down = dict(block_n=128, block_k=64, num_warps=4, num_stages=4)
    else:  # measured best on the H200 at both models' shapes: docs/performance.md, "MoE grouped GEMM kernels"
        gate_up = dict(block_n=128, block_k=64, num_warps=8, num_stages=4)
        down = dict(block_n=256, block_k=64, num_warps=8, num_stages=4)
    gate_up.update(block_n=_fit(inter, gate_up["block_n"], pad_ok=True), block_k=_fit(hidden, gate_up["block_k"]))
    down.update(block_n=_fit(hidden, down["block_n"], pad_ok=True), block_k=_fit(inter, down["block_k"]))
    return dict(block_m=block_m, gate_up=gate_up, down=down)


class KernelTuning(NamedTuple):
    """Launch parameters of one of the two kernels; ``None`` fields keep the default."""

    block_n: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


def _load_bias(ref, e, n0, block_n: int, n_size: int, mask_n: bool, dtype):
    """Bias slice ``ref[e, n0:n0+block_n]`` rounded to ``dtype`` (as the reference adds it), in float32."""
    view = ref.at[e, pl.ds(n0, block_n)]
    if mask_n:
        b = plgpu.load(view, mask=(n0 + jnp.arange(block_n, dtype=jnp.int32)) < n_size, other=0.0)
    else:
        b = view[...]
    return b.astype(dtype).astype(jnp.float32)


def _gate_up_kernel(expert_ref, pair_ref, x_ref, *rest, top_k: int, hidden: int, inter: int, block_k: int,
                    mask_n: bool, mask_k: bool, has_bias: bool, activation: str, alpha: float, limit: float, precision,
                    fmt: expert_tiles.ExpertFormat, num_weight_refs: int):
    gate_refs, up_refs = rest[:num_weight_refs], rest[num_weight_refs:2 * num_weight_refs]
    rest = rest[2 * num_weight_refs:]
    if has_bias:
        gate_bias_ref, up_bias_ref, h_ref = rest
    else:
        (h_ref,) = rest
    block_m, block_n = h_ref.shape
    dtype = x_ref.dtype
    e = expert_ref[0]
    n0 = pl.program_id(0) * block_n

    @pl.when(e >= 0)
    def _():
        pair = pair_ref[...]  # [block_m]: (token * k + slot) of each row, -1 on padding rows
        # Per piece of a K step (``expert_tiles.lhs_pieces``): the token row, whether it is a real row,
        # and the columns past the step's start, of each gathered element.
        pieces = []
        for first, stride, count in expert_tiles.lhs_pieces(fmt, 0, block_k):
            shape = (block_m, count)
            pieces.append((jnp.broadcast_to((jnp.maximum(pair, 0) // top_k)[:, None], shape),
                           jnp.broadcast_to((pair >= 0)[:, None], shape),
                           first + stride * lax.broadcasted_iota(jnp.int32, shape, 1)))

        def load_x(k0, rows, row_ok, cols):
            """Gathered token rows of ``x`` at columns ``k0 + cols`` (zeros on padding rows, past ``H``)."""
            x_mask = row_ok & ((k0 + cols) < hidden) if mask_k else row_ok
            return plgpu.load(x_ref.at[rows, k0 + cols], mask=x_mask, other=0.0)

        tile = dict(block_n=block_n, block_k=block_k, n_size=inter, k_size=hidden, mask_n=mask_n, mask_k=mask_k,
                    dtype=dtype)

        def body(kb, acc):
            acc_g, acc_u = acc
            k0 = kb * block_k
            xs = [load_x(k0, *piece) for piece in pieces]
            for x_piece, g, u in zip(xs, expert_tiles.weight_pieces(gate_refs, fmt, e, n0, k0, **tile),
                                     expert_tiles.weight_pieces(up_refs, fmt, e, n0, k0, **tile)):
                acc_g += plgpu.dot(x_piece, g, trans_b=True, precision=precision)
                acc_u += plgpu.dot(x_piece, u, trans_b=True, precision=precision)
            return acc_g, acc_u

        zeros = jnp.zeros((block_m, block_n), jnp.float32)
        acc_g, acc_u = lax.fori_loop(0, pl.cdiv(hidden, block_k), body, (zeros, zeros))
        if has_bias:
            acc_g += _load_bias(gate_bias_ref, e, n0, block_n, inter, mask_n, dtype)[None, :]
            acc_u += _load_bias(up_bias_ref, e, n0, block_n, inter, mask_n, dtype)[None, :]
        h = gated_activation(acc_g, acc_u, activation, alpha, limit)
        if mask_n:  # the padding columns of the hidden are read by the down kernel: make them zeros
            h = jnp.where((n0 + lax.broadcasted_iota(jnp.int32, (block_m, block_n), 1)) < inter, h, 0.0)
        h_ref[...] = h.astype(h_ref.dtype)


def _down_kernel(expert_ref, pair_ref, weight_ref, h_ref, *rest, hidden: int, inter: int, block_k: int,
                 mask_n: bool, mask_k: bool, has_bias: bool, precision, fmt: expert_tiles.ExpertFormat,
                 num_weight_refs: int):
    down_refs, rest = rest[:num_weight_refs], rest[num_weight_refs:]
    if has_bias:
        bias_ref, o_ref = rest
    else:
        (o_ref,) = rest
    block_m, block_n = o_ref.shape
    dtype = h_ref.dtype
    e = expert_ref[0]
    n0 = pl.program_id(0) * block_n

    @pl.when(e >= 0)
    def _():
        def load_h(first, stride: int, count: int):
            """The hidden's columns ``first + stride * j`` (its padding columns are zeros)."""
            if stride == 1:
                return h_ref[:, pl.ds(first, count)]
            shape = (block_m, count)
            cols = first + stride * lax.broadcasted_iota(jnp.int32, shape, 1)
            return plgpu.load(h_ref.at[lax.broadcasted_iota(jnp.int32, shape, 0), cols])

        tile = dict(block_n=block_n, block_k=block_k, n_size=hidden, k_size=inter, mask_n=mask_n, mask_k=mask_k,
                    dtype=dtype)

        def body(kb, acc):
            k0 = kb * block_k
            hs = [load_h(*piece) for piece in expert_tiles.lhs_pieces(fmt, k0, block_k)]
            for h_piece, d in zip(hs, expert_tiles.weight_pieces(down_refs, fmt, e, n0, k0, **tile)):
                acc += plgpu.dot(h_piece, d, trans_b=True, precision=precision)
            return acc

        acc = lax.fori_loop(0, pl.cdiv(inter, block_k), body, jnp.zeros((block_m, block_n), jnp.float32))
        if has_bias:
            acc += _load_bias(bias_ref, e, n0, block_n, hidden, mask_n, dtype)[None, :]
        # Each row's routing weight, gathered from [T * k] and rounded to x's dtype as the reference
        # rounds it (0 on padding rows).
        pair = pair_ref[...]
        w = plgpu.load(weight_ref.at[jnp.maximum(pair, 0)], mask=pair >= 0, other=0.0)
        acc = acc * w.astype(dtype).astype(jnp.float32)[:, None]
        o_ref[...] = acc.astype(o_ref.dtype)


def _whole(array) -> pl.BlockSpec:
    """Every program sees the whole ``array`` (its tiles are addressed inside the kernel)."""
    return pl.BlockSpec(array.shape, lambda n, b: (0,) * array.ndim)


def weights_problem(gate, up, down) -> str | None:
    """Why the kernels cannot take these expert weights as stored (None: they can): each plain or
    quantized (``expert_tiles``), gate and up stored alike."""
    for name, weight in (("gate", gate), ("up", up), ("down", down)):
        reason = expert_tiles.problem(weight, name)
        if reason:
            return reason
    if expert_tiles.format_of(gate) != expert_tiles.format_of(up):
        return (f"gate ({expert_tiles.format_of(gate)}) and up ({expert_tiles.format_of(up)}) must be stored "
                "alike")
    return None


def unsupported(gate, up, down, *, block_k=None, gate_up_tuning: KernelTuning | None = None,
                down_tuning: KernelTuning | None = None, **options) -> str | None:
    """Why ``moe_mlp`` cannot take these weights with these tuning options (None: it can): the weights'
    storage (``weights_problem``) and a ``K`` step given for a quantized weight that its scales'
    layout cannot take (``expert_tiles.block_k_problem``)."""
    reason = weights_problem(gate, up, down)
    if reason:
        return reason
    for name, weight, own in (("gate_up", gate, gate_up_tuning), ("down", down, down_tuning)):
        step = own.block_k if own is not None and own.block_k is not None else block_k
        reason = step is not None and expert_tiles.block_k_problem(expert_tiles.format_of(weight), step)
        if reason:
            return f"{name}: {reason}"
    return None


def _check_block(name: str, value: int):
    if not _is_pow2(value) or value < 16:
        raise ValueError(f"{name} ({value}) must be a power of two >= 16")


@functools.partial(jax.jit, static_argnames=("activation", "alpha", "limit", "interpret", "block_m", "block_n",
                                             "block_k", "num_warps", "num_stages", "gate_up_tuning", "down_tuning",
                                             "distinct_experts"))
def moe_mlp(x, expert_ids, expert_weights, gate, up, down, *, gate_bias=None, up_bias=None, down_bias=None,
            activation: str = "silu", alpha: float = 1.702, limit: float = 7.0, interpret: bool = False,
            block_m=None, block_n=None, block_k=None, num_warps=None, num_stages=None,
            gate_up_tuning: KernelTuning | None = None, down_tuning: KernelTuning | None = None,
            distinct_experts: bool = False):
    """x [T, H]; expert_ids [T, k] int; expert_weights [T, k] -> [T, H] in x's dtype.

    Same semantics as ``reference.moe_mlp`` (routing weights rounded to x's dtype): weights in
    nn.Linear layout, ``gate``/``up`` [E, I, H], ``down`` [E, H, I] (arrays, or ``Fp8Weight`` /
    ``Mxfp4Weight`` read as stored: ``unsupported`` says which it takes), optional biases [E, I],
    [E, I], [E, H]; expert ids outside ``[0, E)`` are dropped (add nothing).
    Tuning (``None``: ``default_block_sizes``): ``block_m`` rows per row block, ``block_n`` output
    columns and ``block_k`` reduction step per program, Triton ``num_warps``/``num_stages``; a given
    value applies to both kernels; ``gate_up_tuning`` / ``down_tuning`` (``KernelTuning``) set one kernel
    and win over those. Block sizes are powers of two >= 16; ``H`` and ``I`` are arbitrary. A quantized
    weight's ``block_k`` divides its fp8 scale block's width or is whole MXFP4 groups (the defaults are
    fitted so).
    ``distinct_experts`` promises that each token's kept ids differ (top-k routing; dropped ids may
    repeat): then no expert has more than ``T`` rows, and decode-sized calls group their rows without a
    sort.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown MoE activation {activation!r}")
    num_tokens, hidden = x.shape
    num_experts, inter, hidden_w = gate.shape
    top_k = expert_ids.shape[1]
    if expert_ids.shape != (num_tokens, top_k) or expert_weights.shape != (num_tokens, top_k):
        raise ValueError(f"expert_ids {expert_ids.shape} / expert_weights {expert_weights.shape} must be "
                         f"[{num_tokens}, k]")
    if hidden_w != hidden or up.shape != gate.shape or down.shape != (num_experts, hidden, inter):
        raise ValueError(f"expert weights gate {gate.shape}, up {up.shape}, down {down.shape} do not match "
                         f"[E, I, H] / [E, H, I] with H = {hidden}")
    for name, b, n in (("gate_bias", gate_bias, inter), ("up_bias", up_bias, inter), ("down_bias", down_bias, hidden)):
        if b is not None and b.shape != (num_experts, n):
            raise ValueError(f"{name} {b.shape} must be [{num_experts}, {n}]")
    reason = weights_problem(gate, up, down)
    if reason:
        raise ValueError(reason)
    gate_up_format, down_format = expert_tiles.format_of(gate), expert_tiles.format_of(down)
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return jnp.zeros((num_tokens, hidden), x.dtype)

    defaults = default_block_sizes(num_tokens, top_k, num_experts, hidden, inter)
    block_m = defaults["block_m"] if block_m is None else block_m
    launch = {}
    shared = KernelTuning(block_n, block_k, num_warps, num_stages)
    for kernel, own, fmt in (("gate_up", gate_up_tuning, gate_up_format), ("down", down_tuning, down_format)):
        cfg = dict(defaults[kernel])
        cfg["block_k"] = expert_tiles.fit_block_k(fmt, cfg["block_k"])
        for tuning in (shared, own or KernelTuning()):
            cfg.update({key: value for key, value in tuning._asdict().items() if value is not None})
        _check_block(f"{kernel} block_n", cfg["block_n"])
        _check_block(f"{kernel} block_k", cfg["block_k"])
        reason = expert_tiles.block_k_problem(fmt, cfg["block_k"])
        if reason:
            raise ValueError(f"{kernel}: {reason}")
        launch[kernel] = cfg
    _check_block("block_m", block_m)
    gu, dn = launch["gate_up"], launch["down"]

    if num_tokens == 1:  # one token's k experts are distinct: slot j is row block j, no grouping to do
        grouping = group_one_token(expert_ids, block_m, num_experts)
    elif num_pairs <= DECODE_ROWS and (num_pairs <= block_m or (distinct_experts and num_tokens <= block_m)):
        # No expert has more rows than one block: at most T of them with distinct ids.
        grouping = group_few_by_expert(expert_ids, num_experts, block_m)
    else:
        grouping = grouping_pallas.group_by_expert(expert_ids, num_experts, block_m, interpret=interpret)
    nb = grouping.block_expert.shape[0]
    rows = nb * block_m
    row_pair = grouping.row_pair.reshape(nb, block_m)
    block_expert = grouping.block_expert[:, None]  # [NB, 1]

    precision = lax.Precision.HIGHEST if jnp.dtype(x.dtype) == jnp.float32 else None
    inter_pad = _round_up(inter, max(gu["block_n"], dn["block_k"]))  # whole blocks for both kernels
    hidden_pad = _round_up(hidden, dn["block_n"])

    # Kernel A: hidden [rows, I_pad] = act(x[rows] @ gate[e].T, x[rows] @ up[e].T).
    has_bias = gate_bias is not None or up_bias is not None
    gate_inputs, up_inputs = expert_tiles.kernel_inputs(gate), expert_tiles.kernel_inputs(up)
    inputs = [block_expert, row_pair, x, *gate_inputs, *up_inputs]
    in_specs = [
        pl.BlockSpec((None, 1), lambda n, b: (b, 0)),
        pl.BlockSpec((None, block_m), lambda n, b: (b, 0)),
        pl.BlockSpec(x.shape, lambda n, b: (0, 0)),
        *map(_whole, gate_inputs + up_inputs),
    ]
    if has_bias:
        zeros = jnp.zeros((num_experts, inter), x.dtype)
        inputs += [zeros if gate_bias is None else gate_bias, zeros if up_bias is None else up_bias]
        in_specs += [pl.BlockSpec((num_experts, inter), lambda n, b: (0, 0))] * 2
    kernel = functools.partial(
        _gate_up_kernel, top_k=top_k, hidden=hidden, inter=inter, block_k=gu["block_k"], mask_n=inter_pad != inter,
        mask_k=hidden % gu["block_k"] != 0, has_bias=has_bias, activation=activation, alpha=float(alpha),
        limit=float(limit), precision=precision, fmt=gate_up_format, num_weight_refs=len(gate_inputs))
    h = pl.pallas_call(
        pdl.with_trigger(kernel, "moe_gate_up", interpret=interpret),
        grid=(inter_pad // gu["block_n"], nb),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, gu["block_n"]), lambda n, b: (b, n)),
        out_shape=jax.ShapeDtypeStruct((rows, inter_pad), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=gu["num_warps"], num_stages=gu["num_stages"]),
        interpret=interpret,
        name=f"moe_gate_up_{block_m=}_block_n={gu['block_n']}_block_k={gu['block_k']}",
    )(*inputs)

    # Kernel B: out [rows, H_pad] = weight * (hidden @ down[e].T + down_bias[e]).
    flat_weights = expert_weights.reshape(-1)
    down_inputs = expert_tiles.kernel_inputs(down)
    inputs = [block_expert, row_pair, flat_weights, h, *down_inputs]
    in_specs = [
        pl.BlockSpec((None, 1), lambda n, b: (b, 0)),
        pl.BlockSpec((None, block_m), lambda n, b: (b, 0)),
        pl.BlockSpec(flat_weights.shape, lambda n, b: (0,)),
        pl.BlockSpec((block_m, inter_pad), lambda n, b: (b, 0)),
        *map(_whole, down_inputs),
    ]
    if down_bias is not None:
        inputs.append(down_bias)
        in_specs.append(pl.BlockSpec(down_bias.shape, lambda n, b: (0, 0)))
    kernel = functools.partial(
        _down_kernel, hidden=hidden, inter=inter, block_k=dn["block_k"], mask_n=hidden_pad != hidden,
        mask_k=inter % dn["block_k"] != 0, has_bias=down_bias is not None, precision=precision, fmt=down_format,
        num_weight_refs=len(down_inputs))
    out = pl.pallas_call(
        pdl.with_trigger(kernel, "moe_down", interpret=interpret),
        grid=(hidden_pad // dn["block_n"], nb),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, dn["block_n"]), lambda n, b: (b, n)),
        out_shape=jax.ShapeDtypeStruct((rows, hidden_pad), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=dn["num_warps"], num_stages=dn["num_stages"]),
        interpret=interpret,
        name=f"moe_down_{block_m=}_block_n={dn['block_n']}_block_k={dn['block_k']}",
    )(*inputs)

    # Combine: every (token, slot) reads its row (real rows only; a dropped pair is a zero), the k
    # slots summed in float32.
    pair_row = grouping.pair_row
    out = jnp.where((pair_row >= 0)[:, None], out[jnp.maximum(pair_row, 0)], 0)
    if hidden_pad != hidden:
        out = out[:, :hidden]
    return out.reshape(num_tokens, top_k, hidden).astype(jnp.float32).sum(axis=1).astype(x.dtype)


__all__ = ["DECODE_ROWS", "KernelTuning", "default_block_sizes", "moe_mlp"]
