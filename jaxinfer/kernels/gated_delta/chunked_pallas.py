"""The gated delta rule in Pallas (Triton lowering): ``chunked.py``'s WY form in three kernels.

Same contract as ``reference.gated_delta_rule``; the gate is either ``g [T, H]`` (one decay per
head: gated DeltaNet) or ``g [T, H, Dk]`` (one per key channel, ``S = exp(g)[:, None] * S``: Kimi's
KDA), a static switch on g's rank. The step's chunks are ``recurrence.chunk_table``'s (64 rows of one
sequence each); every kernel reads the packed ``[T, H, D]`` rows of its chunk itself (masked past
the chunk's rows), nothing is gathered around the kernels. All arithmetic is float32.

1. ``gated_delta_chunk_prepare``, grid ``(chunk, head)``: the chunk in four sub-chunks of 16 rows.
   The in-chunk cumulative gate ``G``, the decayed products ``L = strict_lower(<beta k, k>_G)``
   blockwise, and ``[W U] = (I + L)^-1 [beta k exp(G)  beta v]`` by block forward substitution
   (``[W U]_i = (I + L_ii)^-1 (rhs_i - sum_{j < i} L_ij [W U]_j)``, each 16 x 16 diagonal block
   inverted row by row in registers), with the keys decayed to the chunk's end ``k exp(G_last -
   G)``, written chunk-major ``[chunks, H, 64, D]``.
2. ``gated_delta_chunk_states``, grid ``(sequence, head, Dv block)``: the only sequential part. A
   program holds its ``[Dk, block_v]`` state in registers and walks its sequence's chunks: it
   writes the state entering each chunk, ``V = U - W S`` and ``S = exp(G_last) S + (k exp(G_last -
   G))^T V``; the state after the last chunk is the final state (an empty sequence: its initial one).
3. ``gated_delta_chunk_output``, grid ``(chunk, head, Dv block)``: per sub-chunk ``i``, ``(q_i
   exp(G_i)) S + sum_{j <= i} <q_i, k_j>_G V_j``, stored straight into the packed output rows
   (padding rows keep the zeros the output starts from).

``<x_i, k_j>_G = sum_c x_ic k_jc exp(G_ic - G_jc)``. With a scalar gate it is a matmul times
``exp(G_i - G_j)``. Per channel, for an earlier sub-chunk it is a matmul of ``x_i exp(G_i - G_n)``
and ``k_j exp(G_n - G_j)`` (``G_n`` the cumulative gate before sub-chunk ``i``, both factors <= 1
for a decaying gate, so nothing overflows however fast the chunk decays); within a sub-chunk the
decays are formed exactly, one key row at a time.

Matmuls take ``precision`` (default ``F32_DOTS``: float32-accurate, on the tensor cores); interpret
mode computes them in float32. Tiles and launch parameters: docs/performance.md, "Gated delta rule
kernels".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.kernels import recurrence
from jaxinfer.kernels.gated_delta import chunked

CHUNK = chunked.CHUNK  # 64 rows
SUB = 16  # rows of a sub-chunk: the triangular solve's blocks, the tensor-core matmul edge
# Key and value head dims: powers of two in this range (128 is what the launch parameters below
# were measured at; wider state rows would need other tiles and warps).
MIN_DIM, MAX_DIM = 16, 128
STATE_PROGRAMS = 256  # the state pass takes Dv blocks of 64 where that gives this many programs, else 32
# Matmuls as three TF32 tensor-core products: as close to the recurrence as Triton's FMA-based
# "ieee" float32 products, and several times faster.
F32_DOTS = lax.DotAlgorithmPreset.TF32_TF32_F32_X3
_TUNING = ("state_block_v", "output_block_v", "precision")
_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _dim_ok(n: int) -> bool:
    return _is_pow2(n) and MIN_DIM <= n <= MAX_DIM


def default_tiles(num_seqs: int, num_heads: int, value_dim: int) -> dict:
    """Dv blocks (at most Dv): the state pass, whose programs are few (sequences x heads x blocks,
    each walking its chunks in turn), takes 64 where that still gives ``STATE_PROGRAMS`` programs,
    else 32; the output kernel, parallel over chunks already, 64."""
    wide = num_seqs * num_heads * (value_dim // 64) >= STATE_PROGRAMS
    return dict(state_block_v=min(value_dim, 64 if wide else 32), output_block_v=min(value_dim, 64))


def _unsupported_reason(q, k, v, g, beta, cu_seqlens, initial_state, options) -> str | None:
    unknown = sorted(set(options) - set(_TUNING))
    if unknown:
        return f"unknown options {unknown}"
    if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or v.shape[:2] != q.shape[:2]:
        return f"q, k must be [T, H, Dk] and v [T, H, Dv], not {q.shape}, {k.shape}, {v.shape}"
    num_tokens, num_heads, key_dim = q.shape
    value_dim = v.shape[-1]
    if num_tokens == 0:
        return "no tokens"
    if not (_dim_ok(key_dim) and _dim_ok(value_dim)):
        return f"Dk ({key_dim}) and Dv ({value_dim}) must be powers of two from {MIN_DIM} to {MAX_DIM}"
    if g.shape not in ((num_tokens, num_heads), (num_tokens, num_heads, key_dim)):
        return f"g must be [T, H] or [T, H, Dk], not {g.shape}"
    if beta.shape != (num_tokens, num_heads):
        return f"beta must be [T, H], not {beta.shape}"
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2 or not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        return f"cu_seqlens must be integer [S + 1], S >= 1, not {cu_seqlens.dtype}{cu_seqlens.shape}"
    if initial_state.shape != (cu_seqlens.shape[0] - 1, num_heads, key_dim, value_dim):
        return f"initial_state must be [S, H, Dk, Dv], not {initial_state.shape}"
    if any(jnp.dtype(x.dtype) not in _FLOATS for x in (q, k, v, g, beta, initial_state)):
        return "q, k, v, g, beta and initial_state must be float32, bfloat16 or float16"
    for name in ("state_block_v", "output_block_v"):
        block = options.get(name)
        if block is not None and not (_is_pow2(block) and MIN_DIM <= block <= value_dim):
            return f"{name} ({block}) must be a power of two from {MIN_DIM} to Dv ({value_dim})"
    return None


def supports(q, k, v, g, beta, cu_seqlens, initial_state, **options) -> bool:
    """Whether the kernels take the call: q, k ``[T, H, Dk]``, v ``[T, H, Dv]`` with Dk and Dv powers
    of two from 16 to 128, T >= 1, g ``[T, H]`` or ``[T, H, Dk]``, beta ``[T, H]``, integer
    cu_seqlens of S >= 1 sequences, initial_state ``[S, H, Dk, Dv]``, float dtypes; only the
    tuning options ``state_block_v``, ``output_block_v`` (powers of two from 16 to Dv) and
    ``precision``."""
    return _unsupported_reason(q, k, v, g, beta, cu_seqlens, initial_state, options) is None


# --- pieces shared by the kernels (traced inside kernel bodies) ---

def _iota(shape, axis):
    return lax.broadcasted_iota(jnp.int32, shape, axis)


def _dot(a, b, *, precision, trans_a: bool = False, trans_b: bool = False):
    """A float32 matmul of two 2-D tiles (``a^T`` / ``b^T`` where asked)."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _rows_valid(block: int, rows):
    """Which rows of sub-chunk ``block`` lie inside the chunk's ``rows``."""
    return block * SUB + _iota((SUB,), 0) < rows


def _load_rows(ref, first, valid):
    """``SUB`` rows of a packed ``[T, ...]`` ref from row ``first`` (dynamic), zeros where not
    ``valid``, as float32."""
    shape = (SUB, *ref.shape[1:])
    mask = jnp.broadcast_to(valid.reshape(SUB, *([1] * (len(shape) - 1))), shape)
    return plgpu.load(ref.at[pl.ds(first, SUB)], mask=mask, other=0.0).astype(jnp.float32)


def _decay_rows(x):
    """``exp(x)`` as a factor on ``[SUB, Dk]`` rows: x ``[SUB]`` (a scalar gate) or ``[SUB, Dk]``."""
    return jnp.exp(x)[:, None] if x.ndim == 1 else jnp.exp(x)


def _decayed_products(a, b, cum_a, cum_b, before_a, *, diagonal: bool, strict: bool, precision):
    """``<a_i, b_j>_G`` for sub-chunks ``i`` (rows of ``a``, gate ``cum_a``) and ``j`` (rows of
    ``b``, ``cum_b``) -> [SUB, SUB]. ``diagonal``: the same sub-chunk, zero above the diagonal (and
    on it where ``strict``); otherwise ``j`` is earlier and ``before_a`` is the cumulative gate
    before ``i`` (per channel only)."""
    if cum_a.ndim == 1:  # one decay per head: exp(G_i - G_j) on the product
        prod = _dot(a, b, trans_b=True, precision=precision)
        decay = cum_a[:, None] - cum_b[None, :]
        if not diagonal:
            return prod * jnp.exp(decay)
        row, col = _iota((SUB, SUB), 0), _iota((SUB, SUB), 1)
        keep = row > col if strict else row >= col
        return jnp.where(keep, prod * jnp.exp(jnp.where(keep, decay, 0.0)), 0.0)
    if not diagonal:  # factors exp(G_i - G_n) and exp(G_n - G_j), both <= 1
        return _dot(a * jnp.exp(cum_a - before_a[None, :]), b * jnp.exp(before_a[None, :] - cum_b), trans_b=True,
                      precision=precision)
    row = _iota((SUB,), 0)
    pick_row = _iota((SUB, 1), 0)
    col = _iota((SUB, SUB), 1)

    def column(j, acc):  # column j: key row j against every row, with its exact decays
        b_j = jnp.sum(jnp.where(pick_row == j, b, 0.0), axis=0)
        g_j = jnp.sum(jnp.where(pick_row == j, cum_b, 0.0), axis=0)
        keep = row > j if strict else row >= j
        decay = jnp.exp(jnp.where(keep[:, None], cum_a - g_j[None, :], 0.0))
        values = jnp.where(keep, jnp.sum(a * b_j[None, :] * decay, axis=1), 0.0)
        return jnp.where(col == j, values[:, None], acc)

    return lax.fori_loop(0, SUB, column, jnp.zeros((SUB, SUB), jnp.float32))


def _unit_lower_inverse(lower):
    """``(I + L)^-1`` of one strictly lower [SUB, SUB] block ``L``, by forward substitution row by row."""
    pick_row = _iota((SUB, 1), 0)
    eye = (_iota((SUB, SUB), 0) == _iota((SUB, SUB), 1)).astype(jnp.float32)

    def substitute(i, n):  # row i of N = (I + L)^-1 - I: -L_i + sum_{j < i} (-L_ij) N_j
        row = jnp.sum(jnp.where(pick_row == i, n, 0.0), axis=0)  # -L_i (rows >= i of n still hold -L)
        row = row + jnp.sum(row[:, None] * n, axis=0)
        return jnp.where(pick_row == i, row[None, :], n)

    return lax.fori_loop(2, SUB, substitute, -lower) + eye  # rows 0 and 1 of -L are final already


# --- 1. within each chunk: G, A = (I + L)^-1, W, U, decayed keys ---

def _prepare_kernel(meta_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, kd_ref, cum_ref, *, precision):
    n = pl.program_id(0)
    start, rows = meta_ref[n, 0], meta_ref[n, 1]
    num_blocks = CHUNK // SUB

    @pl.when(rows > 0)
    def _():
        valid = [_rows_valid(b, rows) for b in range(num_blocks)]
        first = [start + b * SUB for b in range(num_blocks)]
        gates = [_load_rows(g_ref, first[b], valid[b]) for b in range(num_blocks)]  # zero past the rows: no decay
        before, cums = [], []
        carry = jnp.zeros(gates[0].shape[1:], jnp.float32)
        for b in range(num_blocks):
            before.append(carry)
            cums.append(carry[None] + jnp.cumsum(gates[b], axis=0))
            carry = carry + jnp.sum(gates[b], axis=0)
            cum_ref[pl.ds(b * SUB, SUB)] = cums[b]
        last = carry
        keys = [_load_rows(k_ref, first[b], valid[b]) for b in range(num_blocks)]
        betas = [_load_rows(beta_ref, first[b], valid[b]) for b in range(num_blocks)]
        keys_beta = [betas[b][:, None] * keys[b] for b in range(num_blocks)]
        for b in range(num_blocks):
            kd_ref[pl.ds(b * SUB, SUB), :] = keys[b] * _decay_rows(last[None] - cums[b])
        values_beta = [betas[b][:, None] * _load_rows(v_ref, first[b], valid[b]) for b in range(num_blocks)]
        keys_w = [keys_beta[b] * _decay_rows(cums[b]) for b in range(num_blocks)]
        # (I + L) [W U] = [beta k exp(G)  beta v], block row by block row:
        # [W U]_i = (I + L_ii)^-1 ([beta k exp(G)  beta v]_i - sum_{j < i} L_ij [W U]_j).
        w, u = [], []
        for i in range(num_blocks):
            rhs_w, rhs_u = keys_w[i], values_beta[i]
            for j in range(i):
                lower = _decayed_products(keys_beta[i], keys[j], cums[i], cums[j], before[i], diagonal=False,
                                          strict=True, precision=precision)
                rhs_w = rhs_w - _dot(lower, w[j], precision=precision)
                rhs_u = rhs_u - _dot(lower, u[j], precision=precision)
            inverse = _unit_lower_inverse(_decayed_products(keys_beta[i], keys[i], cums[i], cums[i], None,
                                                            diagonal=True, strict=True, precision=precision))
            w.append(_dot(inverse, rhs_w, precision=precision))
            u.append(_dot(inverse, rhs_u, precision=precision))
            w_ref[pl.ds(i * SUB, SUB), :] = w[i]
            u_ref[pl.ds(i * SUB, SUB), :] = u[i]


# --- 2. the state pass: per (sequence, head, Dv block), chunk after chunk ---

def _state_kernel(offsets_ref, initial_ref, w_ref, u_ref, kd_ref, cum_ref, states_ref, v_new_ref, final_ref, *,
                  per_channel: bool, precision):
    s = pl.program_id(0)

    def chunk(n, state):
        states_ref[n] = state  # the state entering chunk n
        v_new = u_ref[n] - _dot(w_ref[n], state, precision=precision)
        v_new_ref[n] = v_new
        if per_channel:
            decay = jnp.exp(cum_ref[n, CHUNK - 1, :])[:, None]
        else:
            decay = jnp.exp(cum_ref[n, CHUNK - 1])
        return decay * state + _dot(kd_ref[n], v_new, trans_a=True, precision=precision)

    state = initial_ref[...].astype(jnp.float32)
    final_ref[...] = lax.fori_loop(offsets_ref[s], offsets_ref[s + 1], chunk, state)


# --- 3. outputs: per (chunk, head, Dv block) ---

def _output_kernel(meta_ref, q_ref, k_ref, cum_ref, states_ref, v_new_ref, _, out_ref, *, precision):
    n = pl.program_id(0)
    start, rows = meta_ref[n, 0], meta_ref[n, 1]
    per_channel = len(cum_ref.shape) == 2

    @pl.when(rows > 0)
    def _():
        state = states_ref[...]

        def sub_chunk(i, carry):  # the chunk's sub-chunks that hold rows, in turn
            first = i * SUB
            valid = first + _iota((SUB,), 0) < rows
            q = _load_rows(q_ref, start + first, valid)
            cum = cum_ref[pl.ds(first, SUB)]
            before = cum_ref[jnp.maximum(first - 1, 0)] if per_channel else None  # used from i = 1 on

            def earlier(j, out):  # an earlier sub-chunk: all its rows lie in the chunk
                keys = k_ref[pl.ds(start + j * SUB, SUB)].astype(jnp.float32)
                scores = _decayed_products(q, keys, cum, cum_ref[pl.ds(j * SUB, SUB)], before, diagonal=False,
                                           strict=False, precision=precision)
                return out + _dot(scores, v_new_ref[pl.ds(j * SUB, SUB)], precision=precision)

            out = lax.fori_loop(0, i, earlier, _dot(q * _decay_rows(cum), state, precision=precision))
            keys = _load_rows(k_ref, start + first, valid)
            scores = _decayed_products(q, keys, cum, cum, None, diagonal=True, strict=False, precision=precision)
            out = out + _dot(scores, v_new_ref[pl.ds(first, SUB)], precision=precision)
            plgpu.store(out_ref.at[pl.ds(start + first, SUB)], out.astype(out_ref.dtype),
                        mask=jnp.broadcast_to(valid[:, None], out.shape))
            return carry

        lax.fori_loop(0, (rows + SUB - 1) // SUB, sub_chunk, 0)


@functools.partial(jax.jit, static_argnames=("interpret",) + _TUNING)
def gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state, *, interpret: bool = False, state_block_v=None,
                     output_block_v=None, precision=None):
    """q, k [T, H, Dk], v [T, H, Dv], g [T, H] or [T, H, Dk], beta [T, H]; cu_seqlens [S + 1];
    initial_state [S, H, Dk, Dv] -> (outputs [T, H, Dv], final states [S, H, Dk, Dv]), float32;
    see ``reference.gated_delta_rule``. Tuning: the Dv blocks (``default_tiles`` where absent) and
    the matmul ``precision`` (``F32_DOTS``). A call ``supports`` refuses raises ValueError."""
    options = dict(state_block_v=state_block_v, output_block_v=output_block_v, precision=precision)
    reason = _unsupported_reason(q, k, v, g, beta, cu_seqlens, initial_state,
                                 {key: value for key, value in options.items() if value is not None})
    if reason is not None:
        raise ValueError(f"gated_delta_rule kernel: {reason}")
    num_tokens, num_heads, key_dim = q.shape
    value_dim = v.shape[-1]
    num_seqs = initial_state.shape[0]
    per_channel = g.ndim == 3
    tiles = default_tiles(num_seqs, num_heads, value_dim)
    block_s = state_block_v or tiles["state_block_v"]
    block_o = output_block_v or tiles["output_block_v"]
    precision = lax.Precision.HIGHEST if interpret else (F32_DOTS if precision is None else precision)

    cu = cu_seqlens.astype(jnp.int32)
    _, start, rows, _ = recurrence.chunk_table(cu, num_tokens, CHUNK)
    num_chunks = start.shape[0]
    meta = jnp.stack([start, rows], axis=1)  # [chunks, 2]
    per_seq = -(-(cu[1:] - cu[:-1]) // CHUNK)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(per_seq).astype(jnp.int32)])  # [S + 1]
    gate_tail = (key_dim,) if per_channel else ()
    f32 = jnp.float32

    def whole(x):
        return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)

    def packed(x):  # one head's rows of a packed [T, H, ...] array
        tail = (0,) * (x.ndim - 2)
        return pl.BlockSpec((num_tokens, None, *x.shape[2:]), lambda c, h, *_: (0, h, *tail))

    def per_chunk(tail, blocked=False):  # one (chunk, head) block of a chunk-major array (blocked: a Dv block)
        zeros = (0,) * len(tail)
        if blocked:
            return pl.BlockSpec((None, None, *tail), lambda c, h, b: (c, h, *zeros[:-1], b))
        return pl.BlockSpec((None, None, *tail), lambda c, h, *_: (c, h, *zeros))

    def all_chunks(tail, blocked=False):  # every chunk of one head: the state pass indexes chunks itself
        zeros = (0,) * len(tail)
        if blocked:
            return pl.BlockSpec((num_chunks, None, *tail), lambda s, h, b: (0, h, *zeros[:-1], b))
        return pl.BlockSpec((num_chunks, None, *tail), lambda s, h, b: (0, h, *zeros))

    # 2 warps for the per-chunk kernels, 4 and no software pipelining for the state pass (as measured
    # fastest on the H200).
    params = lambda warps: plgpu.CompilerParams(num_warps=warps, num_stages=1)  # noqa: E731

    w, u, keys_decayed, cums = pl.pallas_call(
        functools.partial(_prepare_kernel, precision=precision),
        grid=(num_chunks, num_heads),
        in_specs=[whole(meta), packed(k), packed(v), packed(g), packed(beta)],
        out_specs=[per_chunk((CHUNK, key_dim)), per_chunk((CHUNK, value_dim)), per_chunk((CHUNK, key_dim)),
                   per_chunk((CHUNK, *gate_tail))],
        out_shape=[jax.ShapeDtypeStruct((num_chunks, num_heads, CHUNK, key_dim), f32),
                   jax.ShapeDtypeStruct((num_chunks, num_heads, CHUNK, value_dim), f32),
                   jax.ShapeDtypeStruct((num_chunks, num_heads, CHUNK, key_dim), f32),
                   jax.ShapeDtypeStruct((num_chunks, num_heads, CHUNK, *gate_tail), f32)],
        compiler_params=params(2),
        interpret=interpret,
        name="gated_delta_chunk_prepare",
    )(meta, k, v, g, beta)

    state_spec = pl.BlockSpec((None, None, key_dim, block_s), lambda s, h, b: (s, h, 0, b))
    states, v_new, finals = pl.pallas_call(
        functools.partial(_state_kernel, per_channel=per_channel, precision=precision),
        grid=(num_seqs, num_heads, value_dim // block_s),
        in_specs=[whole(offsets), state_spec, all_chunks((CHUNK, key_dim)), all_chunks((CHUNK, block_s), True),
                  all_chunks((CHUNK, key_dim)), all_chunks((CHUNK, *gate_tail))],
        out_specs=[all_chunks((key_dim, block_s), True), all_chunks((CHUNK, block_s), True), state_spec],
        out_shape=[jax.ShapeDtypeStruct((num_chunks, num_heads, key_dim, value_dim), f32),
                   jax.ShapeDtypeStruct((num_chunks, num_heads, CHUNK, value_dim), f32),
                   jax.ShapeDtypeStruct(initial_state.shape, f32)],
        compiler_params=params(4),
        interpret=interpret,
        name="gated_delta_chunk_states",
    )(offsets, initial_state, w, u, keys_decayed, cums)

    out_spec = pl.BlockSpec((num_tokens, None, block_o), lambda c, h, b: (0, h, b))  # one Dv block of a head
    out = pl.pallas_call(
        functools.partial(_output_kernel, precision=precision),
        grid=(num_chunks, num_heads, value_dim // block_o),
        in_specs=[whole(meta), packed(q), packed(k), per_chunk((CHUNK, *gate_tail)),
                  per_chunk((key_dim, block_o), True), per_chunk((CHUNK, block_o), True), out_spec],
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct((num_tokens, num_heads, value_dim), f32),
        input_output_aliases={6: 0},
        compiler_params=params(2),
        interpret=interpret,
        name="gated_delta_chunk_output",
    )(meta, q, k, cums, states, v_new, jnp.zeros((num_tokens, num_heads, value_dim), f32))
    return out, finals


__all__ = ["CHUNK", "F32_DOTS", "default_tiles", "gated_delta_rule", "supports"]
