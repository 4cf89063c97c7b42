"""Ragged paged prefill attention as a Pallas Triton kernel (GPU), same semantics as ``reference.py``.

The step's ``T`` tokens come from several sequences, packed as contiguous runs in increasing sequence
order (padding tokens, ``slot_mapping < 0``, after all real ones). The wrapper cuts every run into
*query blocks* of ``block_q`` consecutive tokens of one sequence (``cdiv(len, block_q)`` blocks per
run, so at most ``cdiv(T, block_q) + S`` blocks in all, a static bound). All ``G = heads // kv_heads``
query heads of one KV head share a program: its tile row ``i * G + g`` is token ``i`` of the block and
head ``g`` of the group (``G`` padded to a power of two), gathered by the kernel straight from the
``[T, heads, d]`` queries through a per-block row index. Each program of the ``(kv_heads,
num_blocks)`` grid walks the block's keys ``block_k`` at a time, each key block one gather of cache
rows through the block table (the caches viewed as ``[pages * page_size, d]`` per KV head; online
softmax in float32), from the first page its first query can see (sliding window) to the last key
its last query can see (causal). Key blocks that every row of the query block sees whole skip the
mask. Pages larger than ``block_k`` are split into virtual pages of ``block_k`` rows (a free
reshape of the cache, and a block table of virtual pages), so key blocks start on page boundaries.
Programs are ordered with the last query blocks (the longest key ranges) first. Each program writes
its rows straight into the ``[T, heads, head_dim]`` output (a gather and scatter in jnp around the
kernel measured slower: docs/performance.md, "Prefill attention, Triton kernel"); padding tokens
get zeros.

Softmax runs in base 2 (``exp2``, logits pre-multiplied by ``log2(e)``). Sinks start the online
softmax (``m = sink``, ``l = 1``), which is the same as one extra column that is dropped. Masked
logits are ``-inf`` against a finite running max, so they add exactly zero; a row that sees nothing
(never a real token) gives zeros, like the reference.

**An fp8 cache** (``kv_cache_dtype="fp8"``, with ``k_scale`` / ``v_scale``): the key blocks are
gathered as e4m3 and converted to q's dtype in registers (exact: e4m3 values are bf16 values), the
scores are multiplied by ``k_scale`` with the softmax scale, and the output by ``v_scale`` (it is
linear in the values). Block sizes count the tiles at q's width. Not measured on a GPU yet.
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from jaxinfer.cache import fp8


_LOG2E = math.log2(math.e)
_M_INIT = -1e30  # finite start of the running max: masked (-inf) logits then give exp2(-inf) = 0
_META = 8  # int32 fields per query block (see query_blocks)
_FP8_COMPUTE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _is_scalar(x) -> bool:
    return math.prod(getattr(x, "shape", ())) == 1


def default_block_sizes(num_tokens: int, group: int, head_dim: int, dtype) -> dict:
    """Block sizes and launch parameters for one call (aimed at Hopper).

    ``block_q * next_pow2(group)`` query rows per program (128; 64 at head_dim 256; never more query
    tokens than the step has, but >= 16 rows for the MMA), ``block_k`` keys per key block (256-byte
    rows: 128, i.e. bf16 at head_dim <= 128; 64 up to 512-byte rows; else 32), as many pipeline stages
    (at most 3) as 224 KiB of shared memory holds. 128 x 128 blocks in 3 stages measured fastest at
    bf16, head_dim 128 (docs/performance.md, "Prefill attention, Triton kernel").
    """
    group_pad = _next_pow2(group)
    itemsize = jnp.dtype(dtype).itemsize
    rows = 64 if head_dim > 128 else 128
    row_bytes = head_dim * itemsize
    block_k = 128 if row_bytes <= 256 else 64 if row_bytes <= 512 else 32
    block_q = max(1, rows // group_pad)
    block_q = max(min(block_q, _next_pow2(num_tokens)), max(1, 16 // group_pad))
    rows = block_q * group_pad
    stage_bytes = 2 * block_k * head_dim * itemsize  # one K and one V tile
    q_bytes = rows * head_dim * itemsize
    num_stages = int(min(3, max(1, (224 * 1024 - q_bytes) // stage_bytes)))
    num_warps = 4 if (head_dim <= 64 and rows * block_k <= 128 * 64) else 8
    return dict(block_q=block_q, block_k=block_k, num_warps=num_warps, num_stages=num_stages)


def query_blocks(positions, token_seq_ids, seq_lens, valid, *, block_q: int, num_blocks: int, page_size: int, block_k: int,
                 pages_per_seq: int, sliding_window):
    """Per-block metadata, with plain jnp.

    Returns ``meta`` [NB, 8] int32 (seq, first page, end of the leading masked key blocks, end of the
    unmasked ones, number of key blocks, end of the key range, 0, 0), ``row_pos`` [NB, block_q] (the
    position of each row's token, -1 for rows past the block's tokens), ``row_tok`` [NB, block_q]
    (its token index, clipped) and ``row_valid`` [NB, block_q]. Block ``b`` of the token order is stored at ``NB - 1 - b`` so the grid starts with the last (the
    longest) blocks.
    """
    t = positions.shape[0]
    tok = jnp.arange(t, dtype=jnp.int32)
    seq = token_seq_ids.astype(jnp.int32)
    prev_seq = jnp.concatenate([jnp.full((1,), -1, jnp.int32), seq[:-1]])
    prev_valid = jnp.concatenate([jnp.zeros((1,), bool), valid[:-1]])
    run_start = valid & ((seq != prev_seq) | ~prev_valid)
    run_first = lax.cummax(jnp.where(run_start, tok, 0), axis=0)
    row = (tok - run_first) % block_q
    block_start = valid & (row == 0)
    block = num_blocks - jnp.cumsum(block_start.astype(jnp.int32))  # stored index: NB - 1 - order
    valid = valid & (block >= 0)  # only with metadata that breaks the contiguity promise
    block = jnp.clip(block, 0, num_blocks - 1)

    drop = jnp.int32(num_blocks)  # out of range: dropped by the scatters
    first_tok = jnp.zeros((num_blocks,), jnp.int32).at[jnp.where(block_start & valid, block, drop)].set(
        tok, mode="drop")
    num_rows = jnp.zeros((num_blocks,), jnp.int32).at[jnp.where(valid, block, drop)].add(1, mode="drop")

    i = jnp.arange(block_q, dtype=jnp.int32)
    row_valid = i[None, :] < num_rows[:, None]
    row_tok = jnp.clip(first_tok[:, None] + i[None, :], 0, t - 1)
    row_pos = jnp.where(row_valid, positions.astype(jnp.int32)[row_tok], -1)

    block_seq = seq[first_tok]
    max_pos = row_pos.max(axis=1)
    min_pos = jnp.where(row_valid, row_pos, 1 << 30).min(axis=1)  # no overflow in min_pos + 1
    kv_end = jnp.minimum(jnp.minimum(max_pos + 1, seq_lens.astype(jnp.int32)[jnp.maximum(block_seq, 0)]),
                         pages_per_seq * page_size)
    kv_end = jnp.maximum(kv_end, 0)  # 0 for unused blocks: no key block at all
    if sliding_window:
        first_key = jnp.clip(min_pos - sliding_window + 1, 0, None)
        first_page = jnp.minimum(first_key // page_size, pages_per_seq)
    else:
        first_page = jnp.zeros_like(kv_end)
    lo = first_page * page_size
    num_kb = (jnp.maximum(kv_end - lo, 0) + block_k - 1) // block_k
    # Key blocks [k_a, k_b) are seen whole by every valid row: no mask needed there.
    if sliding_window:
        need = max_pos - sliding_window + 1 - lo  # window: key block start >= max_pos - W + 1
        k_a = jnp.clip(-((-need) // block_k), 0, num_kb)
    else:
        k_a = jnp.zeros_like(num_kb)
    full_end = jnp.minimum(min_pos + 1, kv_end)  # causal and seq_len: key block end <= full_end
    k_b = jnp.clip((full_end - lo) // block_k, k_a, num_kb)
    zeros = jnp.zeros_like(num_kb)
    meta = jnp.stack([block_seq, first_page, k_a, k_b, num_kb, kv_end, zeros, zeros], axis=1)
    return meta.astype(jnp.int32), row_pos, row_tok, row_valid


def _prefill_kernel(meta_ref, bt_ref, pos_ref, qidx_ref, q_ref, k_ref, v_ref, *rest, page_size: int,
                    pages_per_block: int, group: int, dump_row: int, scale: float, sliding_window,
                    logit_softcap, has_sinks: bool, precision, fp8_cache: bool = False):
    """One (KV head, query block). ``fp8_cache``: the caches are e4m3 and the next input holds
    ``[k_scale, v_scale]``."""
    score_scale = scale
    if fp8_cache:
        kv_scale_ref, *rest = rest
        score_scale = scale * kv_scale_ref[0]
    if has_sinks:
        sink_ref, _, o_ref = rest
    else:
        _, o_ref = rest
    (rows,) = qidx_ref.shape
    head_dim = q_ref.shape[1]
    block_k = pages_per_block * page_size

    seq = meta_ref[0]
    first_page = meta_ref[1]
    k_a = meta_ref[2]
    k_b = meta_ref[3]
    num_kb = meta_ref[4]
    kv_end = meta_ref[5]

    # Rows are gathered from (and written back to) the [T * heads, d] queries / output in place:
    # qidx is each row's token * heads + g, -1 for rows without a query (padding or g >= G), which
    # point at ``dump_row`` and are masked.
    qidx = qidx_ref[...]
    has_query = jnp.broadcast_to((qidx >= 0)[:, None], (rows, head_dim))
    q_rows = jnp.broadcast_to(jnp.where(qidx >= 0, qidx + pl.program_id(0) * group, dump_row)[:, None],
                              (rows, head_dim))
    q_cols = lax.broadcasted_iota(jnp.int32, (rows, head_dim), 1)
    q = plgpu.load(q_ref.at[q_rows, q_cols], mask=has_query, other=0.0)
    row_pos = pos_ref[...]  # [rows]; -1 for rows without a token
    lo = first_page * page_size
    key_cols = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)

    def body(kb, carry, *, masked: bool):
        o, m, l = carry
        # The key block's cache rows, one flat gather ([pages * page_size, d] per KV head): loaded
        # as [block_k, d] tiles with no reshape, K and V both stream through cp.async.
        key_pos = lo + kb * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        cache_rows = (bt_ref[seq, key_pos // page_size] * page_size + key_pos % page_size)[:, None]
        k = k_ref[cache_rows, key_cols]
        v = v_ref[cache_rows, key_cols]
        if fp8_cache:  # e4m3 -> q's dtype, in registers
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        s = plgpu.dot(q, k, trans_b=True, precision=precision)  # [rows, block_k] f32
        if logit_softcap:
            s = (logit_softcap * _LOG2E) * jnp.tanh(s * (score_scale / logit_softcap))
        else:
            s = s * (score_scale * _LOG2E)
        if masked:
            visible = (key_pos[None, :] <= row_pos[:, None]) & (key_pos[None, :] < kv_end)
            if sliding_window:
                visible = visible & (key_pos[None, :] > row_pos[:, None] - sliding_window)
            s = jnp.where(visible, s, -jnp.inf)
        m_next = jnp.maximum(m, s.max(axis=-1))
        alpha = jnp.exp2(m - m_next)
        p = jnp.exp2(s - m_next[:, None])
        l_next = l * alpha + p.sum(axis=-1)
        o_next = o * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
        return o_next, m_next, l_next

    if has_sinks:
        m0 = sink_ref[...]  # already in log2 units
        l0 = jnp.ones((rows,), jnp.float32)
    else:
        m0 = jnp.full((rows,), _M_INIT, jnp.float32)
        l0 = jnp.zeros((rows,), jnp.float32)
    carry = (jnp.zeros((rows, head_dim), jnp.float32), m0, l0)

    def run(start, stop, carry, masked):
        return lax.fori_loop(0, stop - start, lambda i, c: body(start + i, c, masked=masked), carry)

    carry = run(0, k_a, carry, True)  # leading key blocks cut by the sliding window
    carry = run(k_a, k_b, carry, False)  # seen whole by every row
    carry = run(k_b, num_kb, carry, True)  # the causal diagonal and the sequence end
    o, _, l = carry
    if fp8_cache:  # o is linear in the values: their scale once, here
        o = o * kv_scale_ref[1]
    o = o / jnp.where(l == 0.0, 1.0, l)[:, None]
    plgpu.store(o_ref.at[q_rows, q_cols], o.astype(o_ref.dtype), mask=has_query)


def _unsupported_reason(q, k_cache, v_cache, k_scale, v_scale) -> str | None:
    """Why the kernel cannot take these operands, or None where it can."""
    if q.ndim != 3 or k_cache.ndim != 4:
        return f"q must be [T, heads, d] and the caches [kv_heads, pages, page_size, d], not {q.shape}, {k_cache.shape}"
    num_kv_heads, _, page_size, head_dim = k_cache.shape
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        return f"k_cache {k_cache.dtype}{k_cache.shape} and v_cache {v_cache.dtype}{v_cache.shape} differ"
    if q.shape[-1] != head_dim:
        return f"q head_dim {q.shape[-1]} != cache head_dim {head_dim}"
    if q.shape[1] % num_kv_heads:
        return f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}"
    if not _is_pow2(head_dim) or not _is_pow2(page_size):
        return f"head_dim ({head_dim}) and page_size ({page_size}) must be powers of two"
    if fp8.is_fp8(k_cache.dtype):
        if k_scale is None or v_scale is None:
            return "an fp8 cache comes with its k_scale and v_scale"
        if not (_is_scalar(k_scale) and _is_scalar(v_scale)):
            return "k_scale and v_scale must be scalars (shape [] or [1])"
        if jnp.dtype(q.dtype) not in _FP8_COMPUTE_DTYPES:
            return f"q over an fp8 cache must be one of {[d.name for d in _FP8_COMPUTE_DTYPES]}, not {q.dtype}"
    elif k_scale is not None or v_scale is not None:
        return f"k_scale / v_scale are given for a {jnp.dtype(k_cache.dtype).name} cache, which is not fp8"
    return None


def supports(q, k_cache, v_cache, *args, k_scale=None, v_scale=None, **options) -> bool:
    """Whether the kernel takes these operands: K and V caches alike, q's head dim theirs, query heads
    a multiple of the KV heads, head dim and page size powers of two; an fp8 cache with its scalar
    ``k_scale`` and ``v_scale`` and q in bf16 / f16 / f32 (scales only with an fp8 cache)."""
    return _unsupported_reason(q, k_cache, v_cache, k_scale, v_scale) is None


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "logit_softcap", "interpret", "block_q",
                                             "block_k", "pages_per_block", "num_warps", "num_stages"))
def ragged_paged_attention(q, k_cache, v_cache, positions, token_seq_ids, block_tables, seq_lens, *, scale,
                           sliding_window=None, logit_softcap=None, sinks=None, k_scale=None, v_scale=None,
                           interpret=False, block_q=None, block_k=None, pages_per_block=None, num_warps=None,
                           num_stages=None):
    """Queries [T, heads, d] from several sequences (any number of new tokens each) over the paged cache.

    ``k_cache``/``v_cache``: [kv_heads, num_pages, page_size, d], already holding this step's K/V.
    Same semantics as ``reference.ragged_paged_attention``; padding tokens (``slot_mapping < 0``)
    give zeros. Tuning (``None``: ``default_block_sizes``): ``block_q`` query tokens per program (a
    power of two, ``block_q * next_pow2(G) >= 16``), ``block_k`` keys per key block (a power of two
    >= 16; or give ``pages_per_block`` instead, ``block_k = pages_per_block * page_size``), the
    Triton ``num_warps``/``num_stages``. ``head_dim`` and ``page_size`` must be powers of two.
    Tokens of one sequence must be one contiguous run (the engine's packing). fp8 caches come with
    their float32 scalar scales ``k_scale`` / ``v_scale`` (``jaxinfer.cache.fp8``); the kernel then
    computes in q's dtype. A call ``supports`` refuses raises ValueError.
    """
    reason = _unsupported_reason(q, k_cache, v_cache, k_scale, v_scale)
    if reason is not None:
        raise ValueError(f"ragged_paged_attention kernel: {reason}")
    t, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_cache.shape
    fp8_cache = fp8.is_fp8(k_cache.dtype)
    compute_dtype = jnp.dtype(q.dtype) if fp8_cache else jnp.dtype(k_cache.dtype)
    group = num_heads // num_kv_heads
    group_pad = _next_pow2(group)
    defaults = default_block_sizes(t, group, head_dim, compute_dtype)
    if pages_per_block is not None:
        if block_k is not None:
            raise ValueError("give block_k or pages_per_block, not both")
        if not _is_pow2(pages_per_block):
            raise ValueError(f"pages_per_block ({pages_per_block}) must be a power of two")
        block_k = pages_per_block * page_size
    block_q = defaults["block_q"] if block_q is None else block_q
    block_k = defaults["block_k"] if block_k is None else block_k
    num_warps = defaults["num_warps"] if num_warps is None else num_warps
    num_stages = defaults["num_stages"] if num_stages is None else num_stages
    rows = block_q * group_pad
    if not _is_pow2(block_q) or rows < 16:
        raise ValueError(f"block_q ({block_q}) must be a power of two with block_q * {group_pad} >= 16")
    if not _is_pow2(block_k) or block_k < 16:
        raise ValueError(f"block_k ({block_k}) must be a power of two >= 16")

    # Pages larger than a key block are read as `split` virtual pages of `block_k` rows each: the
    # cache reshape is free (contiguous) and the block table lists virtual pages.
    num_seqs, pages_per_seq = block_tables.shape
    block_tables = block_tables.astype(jnp.int32)
    split = max(1, page_size // block_k)
    if split > 1:
        page_size //= split
        num_pages *= split
        pages_per_seq *= split
        k_cache = k_cache.reshape(num_kv_heads, num_pages, page_size, head_dim)
        v_cache = v_cache.reshape(num_kv_heads, num_pages, page_size, head_dim)
        block_tables = (block_tables[:, :, None] * split + jnp.arange(split, dtype=jnp.int32)).reshape(
            num_seqs, pages_per_seq)
    pages_per_block = block_k // page_size

    num_blocks = max(1, min(t, pl.cdiv(t, block_q) + num_seqs))
    meta, row_pos, row_tok, row_valid = query_blocks(
        positions, token_seq_ids, seq_lens, token_seq_ids >= 0, block_q=block_q, num_blocks=num_blocks, page_size=page_size, block_k=block_k,
        pages_per_seq=pages_per_seq, sliding_window=sliding_window)

    # Row i * G_pad + g of a block is token row_tok[i], head g of the program's KV head.
    g = jnp.arange(group_pad, dtype=jnp.int32)
    qidx = row_tok[:, :, None] * num_heads + g[None, None, :]
    qidx = jnp.where(row_valid[:, :, None] & (g < group)[None, None, :], qidx, -1).reshape(num_blocks, rows)
    pos_rows = jnp.repeat(row_pos, group_pad, axis=1)  # [NB, rows]
    # Room for a key block that starts at any page of the table.
    block_tables = jnp.pad(block_tables, ((0, 0), (0, pages_per_block)))

    # The kernel writes the output rows of real tokens in place; padding tokens keep these zeros.
    # Masked-off rows point at row 0: the GPU writes nothing there. Pallas's interpreter turns a
    # masked scatter into read-modify-write, so there they point at one extra row, dropped after.
    out_rows = t * num_heads + (1 if interpret else 0)
    dump_row = t * num_heads if interpret else 0
    out_init = jnp.zeros((out_rows, head_dim), q.dtype)
    q_flat = q.reshape(t * num_heads, head_dim).astype(compute_dtype)
    if interpret:
        q_flat = jnp.pad(q_flat, ((0, 1), (0, 0)))
    flat_spec = pl.BlockSpec((out_rows, head_dim), lambda h, b: (0, 0))
    cache_rows_shape = (num_kv_heads, num_pages * page_size, head_dim)  # a free reshape
    inputs = [meta, block_tables, pos_rows, qidx, q_flat, k_cache.reshape(cache_rows_shape),
              v_cache.reshape(cache_rows_shape)]
    in_specs = [
        pl.BlockSpec((None, _META), lambda h, b: (b, 0)),
        pl.BlockSpec(block_tables.shape, lambda h, b: (0, 0)),
        pl.BlockSpec((None, rows), lambda h, b: (b, 0)),
        pl.BlockSpec((None, rows), lambda h, b: (b, 0)),
        flat_spec,
        pl.BlockSpec((None, num_pages * page_size, head_dim), lambda h, b: (h, 0, 0)),
        pl.BlockSpec((None, num_pages * page_size, head_dim), lambda h, b: (h, 0, 0)),
    ]
    if fp8_cache:
        inputs.append(jnp.stack([jnp.reshape(k_scale, ()), jnp.reshape(v_scale, ())]).astype(jnp.float32))
        in_specs.append(pl.BlockSpec((2,), lambda h, b: (0,)))
    if sinks is not None:
        s = sinks.astype(jnp.float32).reshape(num_kv_heads, group) * _LOG2E
        if group_pad != group:
            s = jnp.pad(s, ((0, 0), (0, group_pad - group)))
        inputs.append(jnp.tile(s, (1, block_q)))  # [kv, rows], row i * G_pad + g -> head g
        in_specs.append(pl.BlockSpec((None, rows), lambda h, b: (h, 0)))
    inputs.append(out_init)
    in_specs.append(flat_spec)

    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
    kernel = functools.partial(
        _prefill_kernel, page_size=page_size, pages_per_block=pages_per_block, group=group, dump_row=dump_row,
        scale=float(scale), sliding_window=sliding_window or None, logit_softcap=logit_softcap or None,
        has_sinks=sinks is not None, precision=precision, fp8_cache=fp8_cache)
    out = pl.pallas_call(
        kernel,
        grid=(num_kv_heads, num_blocks),
        in_specs=in_specs,
        out_specs=flat_spec,
        out_shape=jax.ShapeDtypeStruct((out_rows, head_dim), q.dtype),
        input_output_aliases={len(inputs) - 1: 0},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_prefill_{block_q=}_{block_k=}",
    )(*inputs)
    return out[:t * num_heads].reshape(t, num_heads, head_dim)


__all__ = ["default_block_sizes", "query_blocks", "ragged_paged_attention", "supports"]
