"""Paged decode attention in Pallas (Triton lowering): split-KV flash decoding.

One query token per sequence. Grid ``(sequence, kv_head, split)``: each program takes the ``G``
query heads that share one KV head (padded to 16 rows for the tensor cores as it loads them), walks
its share of the sequence's tokens ``block_tokens`` keys at a time through the block table, and
keeps an online softmax in float32. Splitting the KV length over programs keeps the GPU busy when
there are few sequences. Pages a sliding window has left behind are skipped, not masked.

**Gathering a block.** The caches are viewed as ``[pages * page_size, d]`` rows per KV head (a free
reshape), and a block is one gather of ``block_tokens`` rows, ``page_id * page_size + offset``, from
the block table: any page size, and a ``[block_tokens, d]`` tile with no reshape after the load, so
Triton's pipeliner streams both K and V through ``cp.async`` (a ``[pages, page_size, d]`` gather and
a reshape sent V through registers; docs/performance.md, "Paged decode attention kernel").

**One block per program** (short contexts, few sequences: the common batch-1 case) runs without a
loop: the block's rows and the sequence length are read together, the K/V loads (masked past the
length) wait on both at once, one memory round trip sooner than a loop whose bounds need the length
first.

A second, small kernel merges the splits' partial results (``o``, row max ``m``, row sum ``l``) of
the real heads, one program per head, adds the attention-sink logits and writes the output in the
query's dtype: one launch instead of the several small XLA kernels a jnp epilogue becomes. Only the
real heads' partial rows are stored. With one split the main kernel normalises and writes the output
itself, with no second launch; but the defaults still split as far as there are blocks at small
batches, since a program's blocks run in series (``gpu_check.py --sweep-splits``).

**The fused decode step** (``rotary_paged_decode_attention``, what the models call at a decode step).
The kernel takes the step's raw q, k and v: each program normalises and rotates its q rows and its
KV head's new k itself (``rotary_pallas``'s functions) and reads only the cached positions before the
new token; the split holding the new token's position adds it to its online softmax from registers
and writes k and v into the cache slot (no program reads that row, so the write races with nothing).
One launch of ``rotary_pallas`` per layer goes. Its timings against the two kernels, and the variants
not kept, are in docs/performance.md, "Paged decode attention kernel".

**An fp8 cache** (``kv_cache_dtype="fp8"``): the kernel gathers e4m3 rows (half the bytes of bf16),
converts them to q's dtype in registers (exact: e4m3 values are bf16 values), multiplies the scores
by ``k_scale`` and the output by ``v_scale``. The fused form writes an fp8 cache with the XLA write
(``reference.rotary_cache_write``) and then runs this kernel: the new token is read back quantized,
as the reference reads it. Not measured on a GPU yet; the kernel serves fp8 caches because it reads
half the bytes of the reference's gather of the whole cache.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.cache import fp8
from jaxinfer.kernels import pdl, registry
from jaxinfer.kernels.attention import reference, rotary_pallas

_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)
_WAVES = 4  # programs per SM to aim for: a few waves
_COMBINE_ELEMENTS = 16384  # partial-output elements one combine program (one head) holds in registers


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _load_query(q_ref, rows: int):
    """The program's ``G`` query rows as ``[rows, d]`` (``rows >= 16`` for the tensor cores), the
    padding rows zero: a masked gather in the kernel instead of a padded copy of ``q`` before it."""
    group, head_dim = q_ref.shape
    if group == rows:
        return q_ref[...]
    row = jnp.minimum(lax.broadcasted_iota(jnp.int32, (rows, head_dim), 0), group - 1)
    col = lax.broadcasted_iota(jnp.int32, (rows, head_dim), 1)
    return plgpu.load(q_ref.at[row, col], mask=lax.broadcasted_iota(jnp.int32, (rows, head_dim), 0) < group,
                      other=0.0)


def _store_rows(ref, value, group: int):
    """Store the first ``group`` rows of ``value`` ([rows] or [rows, d]) into ``ref``, which has
    ``ref.shape[0] >= group`` rows: a plain store when the shapes agree, else a masked one."""
    rows = value.shape[0]
    if ref.shape[0] == rows:
        ref[...] = value
        return
    row = lax.broadcasted_iota(jnp.int32, value.shape, 0)
    index = (jnp.minimum(row, group - 1),)
    if value.ndim == 2:
        index += (lax.broadcasted_iota(jnp.int32, value.shape, 1),)
    plgpu.store(ref.at[index], value, mask=row < group)


class FreshToken(NamedTuple):
    """Static options of the fused form (``rotary_paged_decode_attention``): the kernel itself
    normalises and rotates the step's new q and k and writes the new k/v into the cache."""

    has_norm: bool
    eps: float
    rotary_dim: int
    num_slots: int
    q_dtype: str  # the rotated q's dtype (the reference's: q's, promoted with the q norm weight's)
    reads_first: bool = False  # one block per program: issue the K/V reads before the rotation


def _rotary_tables(cos_ref, sin_ref, head_dim: int, fresh: FreshToken):
    """The RoPE column indices and this sequence's cos/sin rows."""
    columns = rotary_pallas.RotaryColumns(head_dim, fresh.rotary_dim)
    seq = pl.program_id(0)
    return columns, columns.table_row(cos_ref, seq), columns.table_row(sin_ref, seq)


def _fresh_query(q, q_ref, tables, q_norm_ref, fresh: FreshToken):
    """The program's raw q rows ``q`` ([rows, d], padding rows zero) normalised and rotated, as
    ``rotary_pallas`` computes them."""
    columns, cos, sin = tables
    rows, head_dim = q.shape
    group = q_ref.shape[0]
    row = lax.broadcasted_iota(jnp.int32, (rows, head_dim), 0)
    partner = jnp.broadcast_to(columns.partner, (rows, head_dim))
    q_partner = plgpu.load(q_ref.at[jnp.minimum(row, group - 1), partner], mask=row < group, other=0.0)
    return rotary_pallas.norm_rotate(q, q_partner, cos, sin, columns, q_norm_ref, fresh.eps).astype(fresh.q_dtype)


def _fresh_kv(k_new_ref, v_new_ref, tables, k_norm_ref, cache_dtype, fresh: FreshToken):
    """The KV head's new k (normalised, rotated) and v as [1, d] rows in the cache's dtype."""
    columns, cos, sin = tables
    head_dim = k_new_ref.shape[-1]
    k_partner = plgpu.load(k_new_ref.at[jnp.zeros((1, head_dim), jnp.int32), columns.partner[None, :]])
    k = rotary_pallas.norm_rotate(k_new_ref[...], k_partner, cos, sin, columns, k_norm_ref, fresh.eps)
    return k.astype(cache_dtype), v_new_ref[...].astype(cache_dtype)


def _kernel(q_ref, k_ref, v_ref, bt_ref, len_ref, *rest, rows, scale, page_size, block_tokens, blocks_per_split,
            sliding_window, logit_softcap, final, has_sinks, num_heads_per_kv, fresh: FreshToken | None,
            fp8_cache: bool = False):
    """One (sequence, KV head, split): the online softmax over the split's blocks. ``final`` (one
    split): normalise, add the sinks and write the output; else write the partial ``o``, ``m``, ``l``.

    ``fresh``: ``q_ref`` holds the raw q rows, and the sequence's last token (position length - 1) is
    the step's new one, taken from registers instead of the cache by the split that holds it, which
    also writes it into the cache.

    ``fp8_cache``: the caches are e4m3, and the next input holds ``[k_scale, v_scale]``.
    """
    split = pl.program_id(2)
    head_dim = q_ref.shape[-1]
    score_scale = scale
    if fp8_cache:
        kv_scale_ref, *rest = rest
        score_scale = scale * kv_scale_ref[0]
    if fresh is not None:
        slot_ref, k_new_ref, v_new_ref, cos_ref, sin_ref, *rest = rest
        q_norm_ref = k_norm_ref = None
        if fresh.has_norm:
            q_norm_ref, k_norm_ref, *rest = rest
        *rest, k_out_ref, v_out_ref = rest
    in_cache = 1 if fresh is not None else 0  # the tokens at the end of the sequence not read from the cache

    def block_rows(block):
        """The cache rows of the block's tokens (``[block_tokens]``; the caches are viewed as
        ``[pages * page_size, d]`` per KV head), read once for K and V. One flat gather of rows
        serves every page size: several whole pages per block or a slice of one."""
        position = block * block_tokens + lax.broadcasted_iota(jnp.int32, (block_tokens,), 0)
        return bt_ref[position // page_size] * page_size + position % page_size

    def gather(ref, rows, mask=None):
        """The block's ``[block_tokens, d]`` keys or values; ``mask`` ([block_tokens]) skips the
        reads of invisible tokens and gives them zeros."""
        index = (rows[:, None], lax.broadcasted_iota(jnp.int32, (1, head_dim), 1))
        values = ref[index] if mask is None else plgpu.load(ref.at[index], mask=mask[:, None], other=0.0)
        return values.astype(q_ref.dtype) if fp8_cache else values  # e4m3 -> q's dtype, in registers

    def visible_tokens(block, length, shape):
        token = block * block_tokens + lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)
        visible = token < length - in_cache
        if sliding_window:
            visible &= token >= length - sliding_window  # the query at length-1 sees j > length-1-W
        return visible

    def scores(q, k):
        s = plgpu.dot(q, k, trans_b=True) * score_scale  # [rows, block_tokens] float32
        if logit_softcap:
            s = logit_softcap * jnp.tanh(s / logit_softcap)
        return s

    def one_block_reads():
        # One block per program (short contexts, few sequences): no loop, so the page ids are read
        # alongside the length instead of after it, and the K/V reads wait on both at once, one
        # memory round trip sooner. A block past the length reads nothing (masked loads).
        cache_rows = block_rows(split)
        length = len_ref[0]
        token_visible = visible_tokens(split, length, (block_tokens,))
        return length, gather(k_ref, cache_rows, token_visible), gather(v_ref, cache_rows, token_visible)

    q = _load_query(q_ref, rows)
    reads = one_block_reads() if blocks_per_split == 1 and fresh is not None and fresh.reads_first else None
    # The rotation before the K/V reads (unless reads_first): measured faster, docs/performance.md,
    # "Paged decode attention kernel".
    if fresh is not None:
        tables = _rotary_tables(cos_ref, sin_ref, head_dim, fresh)
        q = _fresh_query(q, q_ref, tables, q_norm_ref, fresh)
        k_new, v_new = _fresh_kv(k_new_ref, v_new_ref, tables, k_norm_ref, k_ref.dtype, fresh)
    if blocks_per_split == 1:
        length, k, v = reads or one_block_reads()
        visible = visible_tokens(split, length, (rows, block_tokens))
        s = jnp.where(visible, scores(q, k), _MASK)
        m = s.max(axis=-1)
        p = jnp.where(visible, jnp.exp(s - m[:, None]), 0.0)  # an all-invisible block adds nothing
        l = p.sum(axis=-1)
        o = plgpu.dot(p.astype(v.dtype), v)
    else:
        length = len_ref[0]
        lo_block = split * blocks_per_split
        hi_block = jnp.minimum(lo_block + blocks_per_split, pl.cdiv(length, block_tokens))
        if sliding_window:  # pages the window has left behind are skipped, not masked
            lo_block = jnp.maximum(lo_block, jnp.maximum(length - sliding_window, 0) // block_tokens)

        def body(block, carry):
            o, m, l = carry
            cache_rows = block_rows(block)
            k = gather(k_ref, cache_rows)
            v = gather(v_ref, cache_rows)
            s = jnp.where(visible_tokens(block, length, (rows, block_tokens)), scores(q, k), _MASK)
            m_next = jnp.maximum(m, s.max(axis=-1))
            correction = jnp.exp(m - m_next)
            p = jnp.exp(s - m_next[:, None])
            l_next = l * correction + p.sum(axis=-1)
            o_next = o * correction[:, None] + plgpu.dot(p.astype(v.dtype), v)
            return o_next, m_next, l_next

        init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), _MASK, jnp.float32),
                jnp.zeros((rows,), jnp.float32))
        o, m, l = lax.fori_loop(lo_block, jnp.maximum(lo_block, hi_block), body, init)
    if fresh is not None:
        # The new token joins the online softmax in the split that holds its position; that split
        # also writes it into the cache (split 0 for an empty padding sequence, whose slot is < 0).
        span = blocks_per_split * block_tokens
        holds_new = (length > 0) & (split == (length - 1) // span)
        s_new = (q.astype(jnp.float32) * k_new.astype(jnp.float32)).sum(axis=1) * scale  # [rows]
        if logit_softcap:
            s_new = logit_softcap * jnp.tanh(s_new / logit_softcap)
        s_new = jnp.where(holds_new, s_new, _MASK)
        m_next = jnp.maximum(m, s_new)
        correction = jnp.exp(m - m_next)
        p_new = jnp.where(holds_new, jnp.exp(s_new - m_next), 0.0)
        l = l * correction + p_new
        o = o * correction[:, None] + p_new.astype(v_new.dtype).astype(jnp.float32)[:, None] * v_new.astype(jnp.float32)
        m = m_next
        slot = slot_ref[0]

        @pl.when((split == jnp.maximum(length - 1, 0) // span) & (slot >= 0) & (slot < fresh.num_slots))
        def _():
            k_out_ref[pl.ds(slot, 1), :] = k_new
            v_out_ref[pl.ds(slot, 1), :] = v_new

    if fp8_cache:  # o is linear in the values: their scale once, here
        o = o * kv_scale_ref[1]
    group = num_heads_per_kv
    if not final:  # the partial results of the rows the combine reads
        o_ref, m_ref, l_ref = rest
        for ref, value in ((o_ref, o), (m_ref, m), (l_ref, l)):
            _store_rows(ref, value, o_ref.shape[0])
        return
    sink_ref, out_ref = rest if has_sinks else (None, *rest)
    m_max = m
    if has_sinks:  # this program's G sink logits, -inf on padding rows
        real_row = lax.broadcasted_iota(jnp.int32, (rows,), 0) < group
        head = pl.program_id(1) * group + jnp.minimum(lax.broadcasted_iota(jnp.int32, (rows,), 0), group - 1)
        sink = plgpu.load(sink_ref.at[head], mask=real_row, other=-jnp.inf).astype(jnp.float32)
        m_max = jnp.maximum(m, sink)
    weight = jnp.exp(m - m_max)
    denom = l * weight
    if has_sinks:
        denom += jnp.exp(sink - m_max)
    out = (o * (weight / jnp.where(denom == 0, 1.0, denom))[:, None]).astype(out_ref.dtype)
    _store_rows(out_ref, out, group)


def _combine_kernel(o_ref, m_ref, l_ref, *rest, num_splits: int, has_sinks: bool):
    """Merge one head's partial results: ``o_ref`` [P, d], ``m_ref``/``l_ref`` [P] (splits past
    ``num_splits`` are unwritten)."""
    if has_sinks:
        sink_ref, out_ref = rest
    else:
        (out_ref,) = rest
    real = lax.broadcasted_iota(jnp.int32, m_ref.shape, 0) < num_splits
    m = jnp.where(real, m_ref[...], -jnp.inf)
    m_max = m.max()
    if has_sinks:
        sink = sink_ref[0]
        m_max = jnp.maximum(m_max, sink)
    weight = jnp.exp(m - m_max)  # 0 on unwritten splits
    denom = jnp.where(real, l_ref[...] * weight, 0.0).sum()
    if has_sinks:
        denom += jnp.exp(sink - m_max)
    o = jnp.where(real[:, None], o_ref[...] * weight[:, None], 0.0).sum(axis=0)
    out_ref[...] = (o / jnp.where(denom == 0, 1.0, denom)).astype(out_ref.dtype)


def _combine_jnp(o, m, l, sinks):
    """The same merge in jnp, for split counts too large for one combine program."""
    m_max = m.max(axis=2)  # [S, kv, Gp]
    if sinks is not None:
        m_max = jnp.maximum(m_max, sinks[None])
    weight = jnp.exp(m - m_max[:, :, None])
    denom = (l * weight).sum(axis=2)
    if sinks is not None:
        denom = denom + jnp.exp(sinks[None] - m_max)
    return (o * weight[..., None]).sum(axis=2) / jnp.where(denom == 0, 1.0, denom)[..., None]


def default_blocking(num_seqs: int, num_kv_heads: int, pages_per_seq: int, page_size: int, head_dim: int,
                     itemsize: int, sms: int | None = None):
    """(block_tokens, num_splits): K blocks of ~32 KiB for few sequences, ~16 KiB for many
    (16..128 tokens), halved (down to 64 tokens) while there are fewer blocks than SMs; enough splits
    to fill the GPU (``sms``: the target's SMs, by default). Chosen by sweeps and A/Bs on the H200:
    docs/performance.md, "Paged decode attention kernel".
    """
    sms = sms or registry.target_sms()
    pairs = num_seqs * num_kv_heads
    block_bytes = 32768 if pairs < sms else 16384  # fewer (sequence, head) pairs than SMs
    block_tokens = min(128, max(16, _next_pow2(block_bytes // (head_dim * itemsize) + 1) // 2))
    block_tokens = min(block_tokens, _next_pow2(pages_per_seq * page_size))
    num_blocks = lambda tokens: max(1, -(-pages_per_seq * page_size // tokens))  # noqa: E731
    while block_tokens > 64 and pairs * num_blocks(block_tokens) < sms:
        block_tokens //= 2
    wanted = _next_pow2(-(-_WAVES * sms // pairs))
    return block_tokens, min(num_blocks(block_tokens), wanted)


def fused_decode_warps(blocks_per_split: int) -> int:
    """Warps of a fused decode program: 8 where it holds one block (its K/V gather and the q/k
    rotation spread over twice the threads), else 4. 8 warps measured faster in the one-sequence
    Qwen3-30B-A3B decode step: docs/performance.md, "Paged decode attention kernel"."""
    return 8 if blocks_per_split == 1 else 4


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "logit_softcap", "interpret",
                                             "block_tokens", "num_splits", "num_warps", "num_stages"))
def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, *, scale, sliding_window=None,
                           logit_softcap=None, sinks=None, k_scale=None, v_scale=None, interpret=False,
                           block_tokens=None, num_splits=None, num_warps=4, num_stages=3):
    """q [S, heads, d]; caches [kv_heads, num_pages, page_size, d]; block_tables [S, P]; seq_lens [S].
    fp8 caches come with their float32 scales ``k_scale`` / ``v_scale`` (``jaxinfer.cache.fp8``).

    Tuning (``None``: ``default_blocking``): ``block_tokens`` keys per step (a power of two),
    ``num_splits`` programs per (sequence, KV head), Triton ``num_warps``/``num_stages``.
    """
    fp8.check_scale(k_cache, k_scale, "K")
    fp8.check_scale(v_cache, v_scale, "V")
    kv_scales = None if k_scale is None else jnp.stack([k_scale, v_scale]).astype(jnp.float32)
    out, _ = _decode(q, k_cache, v_cache, block_tables, seq_lens, scale=scale, sliding_window=sliding_window,
                     logit_softcap=logit_softcap, sinks=sinks, interpret=interpret, block_tokens=block_tokens,
                     num_splits=num_splits, num_warps=num_warps, num_stages=num_stages, kv_scales=kv_scales)
    return out


@functools.partial(jax.jit, static_argnames=("scale", "norm_eps", "sliding_window", "logit_softcap", "interpret",
                                             "block_tokens", "num_splits", "num_warps", "num_stages",
                                             "kv_reads_first"),
                   donate_argnums=(5, 6))
def rotary_paged_decode_attention(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens, *,
                                  scale, q_norm=None, k_norm=None, norm_eps: float = 1e-6, sliding_window=None,
                                  logit_softcap=None, sinks=None, k_scale=None, v_scale=None, interpret=False,
                                  block_tokens=None, num_splits=None, num_warps=None, num_stages=3,
                                  kv_reads_first=False):
    """``reference.rotary_paged_decode_attention`` (the q/k norm, RoPE, cache write and decode attention
    of one step) in one launch (plus the split merge): ``rotary_pallas``'s work is done by the
    attention programs themselves. q [S, heads, d], k/v [S, kv_heads, d], cos/sin [S, rotary_dim];
    the caches are updated in place -> (out, k_cache, v_cache). Power-of-two head counts and head
    dims (else the two kernels run one after the other). As at every decode step, ``slot_mapping[s]``
    must be the block table's slot for position ``seq_lens[s] - 1``: the kernel takes that position
    from registers, not from the cache.

    Tuning as ``paged_decode_attention``'s, except ``num_warps=None``: ``fused_decode_warps``.
    ``kv_reads_first``: with one block per program, issue the K/V reads before the rotation (off:
    measured no faster, docs/performance.md, "Paged decode attention kernel"). fp8 caches (with
    ``k_scale`` / ``v_scale``) take the XLA cache write, then ``paged_decode_attention``."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_cache.shape
    rotary_dim = cos.shape[-1]
    reference.check_qk_norm(q_norm, k_norm)
    attention = dict(scale=scale, sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks,
                     interpret=interpret, block_tokens=block_tokens, num_splits=num_splits, num_warps=num_warps,
                     num_stages=num_stages)
    if fp8.is_fp8(k_cache.dtype) or fp8.is_fp8(v_cache.dtype):
        q, k_cache, v_cache = reference.rotary_cache_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
                                                           q_norm=q_norm, k_norm=k_norm, norm_eps=norm_eps,
                                                           k_scale=k_scale, v_scale=v_scale)
        out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, k_scale=k_scale, v_scale=v_scale,
                                     **attention)
        return out, k_cache, v_cache
    fp8.check_scale(k_cache, k_scale, "K")
    if not rotary_pallas.shapes_fit(num_heads, num_kv_heads, head_dim, rotary_dim):
        q, k_cache, v_cache = rotary_pallas.rotary_cache_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
                                                               q_norm=q_norm, k_norm=k_norm, norm_eps=norm_eps,
                                                               interpret=interpret)
        return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, **attention), k_cache, v_cache
    has_norm = q_norm is not None
    fresh = FreshToken(has_norm=has_norm, eps=float(norm_eps), rotary_dim=rotary_dim,
                       num_slots=num_pages * page_size,
                       q_dtype=jnp.dtype(jnp.result_type(q_norm, q) if has_norm else q.dtype).name,
                       reads_first=kv_reads_first)
    inputs = [slot_mapping.astype(jnp.int32)[:, None], k, v, cos.astype(jnp.float32), sin.astype(jnp.float32)]
    if has_norm:
        inputs += [q_norm, k_norm]
    out, (k_cache_out, v_cache_out) = _decode(q, k_cache, v_cache, block_tables, seq_lens, fresh=fresh,
                                              fresh_inputs=inputs, **attention)
    return out, k_cache_out, v_cache_out


def _decode(q, k_cache, v_cache, block_tables, seq_lens, *, scale, sliding_window, logit_softcap, sinks, interpret,
            block_tokens, num_splits, num_warps, num_stages, fresh: FreshToken | None = None, fresh_inputs=(),
            kv_scales=None):
    """The decode kernel and the split merge -> (out, updated caches or None). ``fresh``: the fused
    form, ``q`` raw, ``fresh_inputs`` = slot_mapping [S, 1], k, v, cos, sin[, q_norm, k_norm].
    ``kv_scales``: ``[k_scale, v_scale]`` of fp8 caches (not with ``fresh``)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    rows = max(16, _next_pow2(group))
    auto_tokens, auto_splits = default_blocking(num_seqs, num_kv_heads, block_tables.shape[1], page_size, head_dim,
                                                q.dtype.itemsize)
    block_tokens = block_tokens or auto_tokens
    tokens_per_seq = block_tables.shape[1] * page_size
    num_blocks = -(-tokens_per_seq // block_tokens)
    blocks_per_split = -(-num_blocks // min(num_blocks, num_splits or auto_splits))
    num_splits = -(-num_blocks // blocks_per_split)
    # Whole splits of whole blocks are read from the block table: pad it (padding is masked by length).
    padded_pages = -(-num_splits * blocks_per_split * block_tokens // page_size)
    block_tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_pages - block_tables.shape[1])))
    out_dtype = q.dtype if fresh is None else jnp.dtype(fresh.q_dtype)

    # A power-of-two group is padded to ``rows`` inside the kernel; any other is padded here (Triton
    # blocks are powers of two).
    q_group = group if _next_pow2(group) == group else rows
    q_rows = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    if q_group != group:
        q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, q_group - group), (0, 0)))
    final = num_splits == 1  # one pass writes the output; no partial results to merge
    if num_warps is None:
        num_warps = fused_decode_warps(blocks_per_split) if fresh is not None else 4
    kernel = functools.partial(_kernel, rows=rows, scale=scale, page_size=page_size, block_tokens=block_tokens,
                               blocks_per_split=blocks_per_split, sliding_window=sliding_window,
                               logit_softcap=logit_softcap, final=final, has_sinks=final and sinks is not None,
                               num_heads_per_kv=group, fresh=fresh, fp8_cache=kv_scales is not None)
    # Each KV head's pages as one [pages * page_size, d] array of rows (a free reshape).
    cache_rows_shape = (num_kv_heads, k_cache.shape[1] * page_size, head_dim)
    cache_spec = pl.BlockSpec((None,) + cache_rows_shape[1:], lambda s, h, k: (h, 0, 0))
    inputs = [q_rows, k_cache.reshape(cache_rows_shape), v_cache.reshape(cache_rows_shape), block_tables,
              seq_lens.astype(jnp.int32)[:, None]]
    in_specs = [
        pl.BlockSpec((None, None, q_group, head_dim), lambda s, h, k: (s, h, 0, 0)),
        cache_spec,
        cache_spec,
        pl.BlockSpec((None, padded_pages), lambda s, h, k: (s, 0)),
        pl.BlockSpec((None, 1), lambda s, h, k: (s, 0)),
    ]
    if kv_scales is not None:
        inputs.append(kv_scales)
        in_specs.append(pl.BlockSpec((2,), lambda s, h, k: (0,)))
    if fresh is not None:  # slot [S, 1], this KV head's new k and v rows, the cos/sin tables, the norms
        slots, k_new, v_new, *whole_arrays = fresh_inputs
        new_row = pl.BlockSpec((None, 1, head_dim), lambda s, h, k: (s, h, 0))
        inputs += [slots, k_new, v_new, *whole_arrays]
        in_specs += [pl.BlockSpec((None, 1), lambda s, h, k: (s, 0)), new_row, new_row]
        in_specs += [pl.BlockSpec(a.shape, lambda s, h, k, n=a.ndim: (0,) * n) for a in whole_arrays]
    if final:
        if sinks is not None:
            inputs.append(sinks)
            in_specs.append(pl.BlockSpec(sinks.shape, lambda s, h, k: (0,)))
        # The padding rows are not stored on the GPU (a masked store); the interpreter's masked store
        # reads and rewrites the masked addresses, so there they get rows of their own.
        out_rows = rows if interpret else q_group
        out_specs = [pl.BlockSpec((None, None, out_rows, head_dim), lambda s, h, k: (s, h, 0, 0))]
        out_shape = [jax.ShapeDtypeStruct((num_seqs, num_kv_heads, out_rows, head_dim), out_dtype)]
    else:
        # The split axis is allocated to a power of two for the combine kernel; splits past
        # num_splits are never written and the combine masks them. Only the rows the combine reads
        # (the real heads, padded to a power of two) are stored; the interpreter's masked store
        # touches the masked rows too, so there every row is.
        split_slots = _next_pow2(num_splits)
        stored_rows = rows if interpret else _next_pow2(group)
        partial_shape = (num_seqs, num_kv_heads, split_slots, stored_rows)
        out_specs = [
            pl.BlockSpec((None, None, None, stored_rows, head_dim), lambda s, h, k: (s, h, k, 0, 0)),
            pl.BlockSpec((None, None, None, stored_rows), lambda s, h, k: (s, h, k, 0)),
            pl.BlockSpec((None, None, None, stored_rows), lambda s, h, k: (s, h, k, 0)),
        ]
        out_shape = [jax.ShapeDtypeStruct(partial_shape + (head_dim,), jnp.float32),
                     jax.ShapeDtypeStruct(partial_shape, jnp.float32),
                     jax.ShapeDtypeStruct(partial_shape, jnp.float32)]
    aliases = {}
    if fresh is not None:  # the caches, updated in place
        aliases = {1: len(out_shape), 2: len(out_shape) + 1}
        out_specs += [cache_spec, cache_spec]
        out_shape += [jax.ShapeDtypeStruct(cache_rows_shape, k_cache.dtype)] * 2
    result = pl.pallas_call(
        pdl.with_trigger(kernel, "decode_attention", interpret=interpret),
        grid=(num_seqs, num_kv_heads, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_decode_attention" if fresh is None else "rotary_paged_decode_attention",
    )(*inputs)
    caches = None
    if fresh is not None:
        *result, k_rows, v_rows = result
        caches = (k_rows.reshape(k_cache.shape), v_rows.reshape(v_cache.shape))
    if final:
        return result[0][:, :, :group].reshape(num_seqs, num_heads, head_dim), caches
    o, m, l = result

    # The merge reads the first group_rows rows (the real heads, padded to a power of two), one
    # program per head: many small programs finish sooner than one per KV head walking its group.
    group_rows = _next_pow2(group)
    sink_rows = None
    if sinks is not None:
        sink_rows = sinks.astype(jnp.float32).reshape(num_kv_heads, group)
        sink_rows = jnp.pad(sink_rows, ((0, 0), (0, group_rows - group)), constant_values=-jnp.inf)
    if split_slots * head_dim > _COMBINE_ELEMENTS:
        real = (slice(None), slice(None), slice(0, num_splits), slice(0, group_rows))
        out = _combine_jnp(o[real], m[real], l[real], sink_rows)
        return out[:, :, :group].reshape(num_seqs, num_heads, head_dim).astype(out_dtype), caches
    inputs = [o, m, l]
    in_specs = [
        pl.BlockSpec((None, None, split_slots, None, head_dim), lambda s, h, r: (s, h, 0, r, 0)),
        pl.BlockSpec((None, None, split_slots, None), lambda s, h, r: (s, h, 0, r)),
        pl.BlockSpec((None, None, split_slots, None), lambda s, h, r: (s, h, 0, r)),
    ]
    if sinks is not None:
        inputs.append(sink_rows[..., None])
        in_specs.append(pl.BlockSpec((None, None, 1), lambda s, h, r: (h, r, 0)))
    out = pl.pallas_call(
        pdl.with_trigger(functools.partial(_combine_kernel, num_splits=num_splits, has_sinks=sinks is not None),
                         "decode_combine", interpret=interpret),
        grid=(num_seqs, num_kv_heads, group_rows),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, None, head_dim), lambda s, h, r: (s, h, r, 0)),
        out_shape=jax.ShapeDtypeStruct((num_seqs, num_kv_heads, group_rows, head_dim), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="paged_decode_combine",
    )(*inputs)
    return out[:, :, :group].reshape(num_seqs, num_heads, head_dim), caches
