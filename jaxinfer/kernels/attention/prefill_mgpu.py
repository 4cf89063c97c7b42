"""Ragged paged prefill attention as a warp-specialised Pallas Mosaic GPU kernel (Hopper: wgmma, TMA).

Same semantics as ``reference.ragged_paged_attention`` for causal attention without sliding window,
soft-cap or sinks (``supports`` says which calls it takes). The structure follows jax's
``attention_mgpu`` (FlashAttention-3's): three warpgroups per program. Two compute warpgroups own
64 query rows each and run the online softmax with both matmuls on the tensor cores (``wgmma``); the
third only moves data: its first warp loads key/value blocks through TMA into a ring of
shared-memory slots that the compute warpgroups release once read.

What differs from ``attention_mgpu``:

- **Ragged query blocks.** The step's tokens are cut into blocks of 128 consecutive tokens of one
  sequence by ``prefill_pallas.query_blocks`` (the Triton kernel's schedule, longest blocks first):
  a program takes one block and one query head. Its rows are one contiguous run of tokens and
  positions, so the causal mask of row ``r`` is ``key <= first_pos + r``. A block starts at any
  token, which a tiled TMA load cannot (tiles of 8 rows need an aligned start): the query rows land
  untiled and the QK matmul takes them from registers. A block's last rows may belong to no token:
  their outputs are never stored (TMA stores of a power-of-two ladder of row counts write exactly
  the real rows). Padding tokens (``slot_mapping < 0``) form blocks without keys, whose rows get
  zeros from the kernel itself.
- **Paged keys.** A key block of 128 keys is ``128 / page_size`` pages, each one TMA copy of a
  ``[page_size, head_dim]`` page into its rows of the slot (as are the values); the slot's one
  barrier expects an arrival per key page and per value page. Pages larger than 128 keys are read
  as virtual pages of 128 (a free reshape).
- **Key range.** Keys run to the block's last visible key (``kv_end``: causal and the sequence's
  length); a compute warpgroup whose rows see fewer key blocks releases the remaining slots without
  computing (the memory warpgroup always loads the block's whole range).
- Logits are scaled by ``scale * log2(e)`` inside the softmax (``exp2``), the queries are not.

The attention dispatcher takes this kernel on Hopper GPUs for the calls ``supports`` accepts, the
Triton kernel (``prefill_pallas``) for the rest. Measured on the H200 (``scripts/gpu_check.py``),
its kernel runs causal prefill at 0.98-1.05x of cuDNN's kernel over pages of 16 (0.99-1.05x over
pages of 64), and its whole op at 1.6-2.1x the Triton kernel's. Merging the K and V barriers gained
about 1%, issuing the copies from one warp (they were issued by all four) 1-2% more. Tried and not
kept, each timed against this kernel in one run:

- persistent programs (one per SM looping over blocks in round-robin or snake order): slower, as a
  static order balances the causal blocks' unequal costs worse than the hardware's block scheduler;
- a tiled shared-memory copy of the queries: no faster;
- FlashAttention-3's intra-warpgroup overlap (the QK matmul of key block j issued with the PV
  matmul of block j - 1, the softmax run while PV is in flight): 0.88-0.93x. The probabilities must
  stay in float32 until PV is done: converting them while it runs makes ptxas serialise every wgmma;
- programs ordered KV head by KV head (so that the programs running at a time share one head's keys
  in L2): 0.84x at 2 x 2048, unchanged at 1 x 8192;
- the copies spread over the memory warpgroup's four warps: 0.99x of one warp;
- key blocks of 192 in 2 stages (the most that fits in shared memory): ptxas spills registers
  (576 bytes), 0.71-0.82x at 1 x 8192;
- the compute warpgroups meeting on a hardware named barrier (``bar.sync``) instead of the
  ``schedule`` mbarrier (every use of which is an arrival followed at once by a wait): 0.85x;
- the softmax row sums on the tensor cores (``p @ ones`` beside ``p @ V``, in place of 64 adds per
  thread per key block): 1.00x at 1 x 8192, 0.98x at 2 x 2048. Per key block a compute thread runs
  about 64 each of ``ex2``, ``fma``, ``max``, ``mul`` (the rescale) and ``add`` (the row sums), 32 ``cvt``
  and 8 shuffles (from the PTX): FlashAttention's minimum, so fewer softmax instructions alone do
  not close the gap to cuDNN.

Nsight Compute at 1 x 8192 against cuDNN's kernel, before the merged barriers and the one-warp
copies: 2.4% more cycles (and a 2% lower SM clock). cuDNN's persistent grid leaves SMs idle 8% of its
cycles where ours leaves 1.5%, but in busy cycles we needed 10% more and issued 25% more
instructions. Pages of 128 still run about 1% faster than pages of 16 (two page copies per key block
instead of sixteen).
"""

from __future__ import annotations

import functools
import inspect
import math

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from jaxinfer.cache.metadata import AttentionMetadata
from jaxinfer.kernels.attention.prefill_pallas import query_blocks

BLOCK_Q = 64  # query rows per compute warpgroup (one wgmma M tile)
BLOCK_KV = 128  # keys per key block
COMPUTE_WGS = 2
STAGES = 3  # key/value blocks in flight: 3 x 64 KiB with the 32 KiB query/output buffer fills shared memory
COMPUTE_REGISTERS, MEMORY_REGISTERS = 240, 24  # per thread: 2 x 128 x 240 + 128 x 24 <= 64K
_LOG2E = math.log2(math.e)


def supports(q, k_cache, *, sliding_window=None, logit_softcap=None, sinks=None) -> bool:
    """Whether this kernel takes the call (else the Triton kernel does)."""
    head_dim = q.shape[-1]
    page_size = k_cache.shape[2]
    pages_fit = page_size % 8 == 0 and (BLOCK_KV % page_size == 0 or page_size % BLOCK_KV == 0)  # TMA row tiles of 8
    return (sliding_window is None and logit_softcap is None and sinks is None and head_dim in (64, 128)
            and jnp.dtype(q.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and pages_fit
            and q.dtype == k_cache.dtype)


def _load(ref, layout):
    """``plgpu.load`` of a whole ref: jax 0.11 made its index argument optional (and deprecated it),
    0.10 requires it."""
    if inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout, optimized=False)
    return plgpu.load(ref, layout=layout, optimized=False)


def _kernel(meta_ref, bt_ref, q_ref, k_ref, v_ref, out_ref, scoped, *, scale: float, group: int, page_size: int,
            stages: int):
    (qo_smem2, k_smem, v_smem), (kv_ready, q_ready), kv_free, schedule = scoped
    head_dim = q_ref.shape[-1]
    num_heads = q_ref.shape[1]
    pages_per_block = BLOCK_KV // page_size
    pages_per_seq = bt_ref.shape[1]
    dtype = q_ref.dtype
    # A program is one (query block, head) pair, heads fastest (a KV head's query heads run side by
    # side and share its pages in L2), the longest blocks first.
    program = lax.axis_index("programs")
    block, head = lax.div(program, jnp.int32(num_heads)), lax.rem(program, jnp.int32(num_heads))
    seq, num_kb, kv_end = meta_ref[block, 0], meta_ref[block, 1], meta_ref[block, 2]
    first_tok, first_pos, num_rows = meta_ref[block, 3], meta_ref[block, 4], meta_ref[block, 5]
    wg = lax.axis_index("wg")

    def schedule_barrier():
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        qo_smem = qo_smem2.at[wg]  # the query rows as loaded, later the output rows
        row0 = wg * BLOCK_Q
        rows = jnp.clip(num_rows - row0, 0, BLOCK_Q)  # this warpgroup's real rows
        pos0 = first_pos + row0  # position of its first row
        # Key blocks it computes: up to its last row's last visible key; the first `full` of them
        # are visible to every one of its rows (no mask).
        last_key = jnp.minimum(pos0 + jnp.maximum(rows, 1), kv_end)
        steps = jnp.where(rows > 0, lax.div(jnp.maximum(last_key, 0) + BLOCK_KV - 1, BLOCK_KV), 0)
        full = jnp.clip(lax.div(jnp.minimum(pos0 + 1, kv_end), BLOCK_KV), 0, steps)

        def slot_of(step):
            return lax.rem(step, jnp.int32(stages))

        # A block starts at any token, so its query rows cannot be TMA-loaded into a tiled buffer
        # (tiles of 8 rows need an aligned start): they land untiled, and the QK matmul reads them
        # from registers, loaded once. (A tiled copy in shared memory measured no faster.)
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(first_tok + row0, BLOCK_Q), head], qo_smem, q_ready.at[wg])
        plgpu.barrier_wait(q_ready.at[wg])
        q_regs = _load(qo_smem, plgpu.Layout.WGMMA)
        m_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.full((BLOCK_Q, head_dim), 0, jnp.float32), plgpu.Layout.WGMMA)

        @pl.when(steps > 0)
        def _():
            plgpu.barrier_wait(kv_ready.at[slot_of(0)])

        pl.when(wg == 1)(schedule_barrier)  # the two warpgroups take the tensor cores in turn

        def kv_step(step, carry, masked: bool):
            acc, m_i, l_i = carry
            slot = slot_of(step)

            def qk_scope(acc_ref):
                plgpu.wgmma(acc_ref, q_regs, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                schedule_barrier()
                return acc_ref[...]

            qk = pl.run_scoped(qk_scope, plgpu.ACC((BLOCK_Q, BLOCK_KV), jnp.float32))
            if masked:  # causal (key <= the row's position) and the sequence's end (key < kv_end)
                r = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, BLOCK_KV), 0, layout=plgpu.Layout.WGMMA)
                c = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, BLOCK_KV), 1, layout=plgpu.Layout.WGMMA)
                key = c + step * BLOCK_KV
                qk = jnp.where((key <= r + pos0) & (key < kv_end), qk, -jnp.inf)
            m_ij = jnp.maximum(m_i, qk.max(axis=1) * (scale * _LOG2E))
            alpha = jnp.exp2(m_i - m_ij)
            p = jnp.exp2(qk * (scale * _LOG2E) - lax.broadcast_in_dim(m_ij, qk.shape, [0]))
            acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
            l_i = l_i * alpha + p.sum(axis=1)
            p16 = p.astype(dtype)
            acc, l_i, m_ij, p16 = lax.optimization_barrier((acc, l_i, m_ij, p16))
            plgpu.barrier_arrive(schedule)  # done with the softmax
            plgpu.barrier_wait(schedule)  # the tensor cores are free

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

                @pl.when(step + 1 < steps)
                def _():
                    plgpu.barrier_wait(kv_ready.at[slot_of(step + 1)])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(kv_free.at[slot])  # keys and values read
            return acc, m_ij, l_i

        carry = lax.fori_loop(0, full, functools.partial(kv_step, masked=False), (acc, m_i, l_i))
        acc, m_i, l_i = lax.fori_loop(full, steps, functools.partial(kv_step, masked=True), carry)

        @pl.loop(steps, num_kb)
        def _release(step):  # key blocks only the other warpgroup's rows see
            slot = slot_of(step)  # waited for all the same: every load lands before the program ends
            plgpu.barrier_wait(kv_ready.at[slot])
            plgpu.barrier_arrive(kv_free.at[slot])
            schedule_barrier()
            schedule_barrier()

        pl.when(wg == 0)(schedule_barrier)
        # Rows without keys (padding tokens) have l = acc = 0: their output is 0.
        l_i = jnp.maximum(l_i, jnp.float32(1e-30))
        acc /= lax.broadcast_in_dim(l_i, (BLOCK_Q, head_dim), [0])
        qo_smem[...] = acc.astype(dtype)
        plgpu.commit_smem()
        # Only the real rows, as a ladder of power-of-two row counts (TMA shapes are static): the
        # chunk of n rows exists when bit n of `rows` is set, and starts after the larger chunks.
        n = BLOCK_Q
        while n:
            start = rows & ~(2 * n - 1)

            @pl.when((rows & n) != 0)
            def _(start=start, n=n):
                plgpu.copy_smem_to_gmem(qo_smem.at[pl.ds(start, n)],
                                        out_ref.at[pl.ds(first_tok + row0 + start, n), head])

            n //= 2
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
        kv_head = lax.div(head, jnp.int32(group))

        # One warp issues the copies: in warpgroup form each copy costs a warpgroup barrier and an
        # arrival from each of the 128 threads, and the memory warpgroup's four warps then take issue
        # slots from the compute warpgroups (1-2% of the kernel's speed with pages of 16 or 64).
        @plgpu.warp_map
        def _per_warp(warp):
            @pl.when(warp == 0)
            def _():
                @pl.loop(0, num_kb)
                def _load(step):
                    slot = lax.rem(step, jnp.int32(stages))

                    @pl.when(step >= stages)
                    def _():  # the slot's previous key block has been read by both warpgroups
                        plgpu.barrier_wait(kv_free.at[slot])

                    for j in range(pages_per_block):
                        index = jnp.minimum(step * pages_per_block + j, pages_per_seq - 1)
                        page = jnp.maximum(bt_ref[seq, index], 0)
                        rows = pl.ds(j * page_size, page_size)
                        plgpu.copy_gmem_to_smem(k_ref.at[kv_head, page], k_smem.at[slot, rows], kv_ready.at[slot])
                        plgpu.copy_gmem_to_smem(v_ref.at[kv_head, page], v_smem.at[slot, rows], kv_ready.at[slot])


def block_schedule(md: AttentionMetadata, *, page_size: int, pages_per_seq: int) -> jax.Array:
    """The query blocks of a step, [num_blocks, 8] int32, one row per block: (sequence, key blocks,
    end of the key range, first token, first position, tokens, 0, 0). Blocks run in reverse token
    order (the last blocks of a sequence, the longest key ranges, first); unused rows, without
    tokens, come before them.

    Padding tokens (slot < 0) become blocks of their own without keys, so that the kernel writes
    their zeros too (no pass over the output afterwards). The static block count allows one partial
    block per run of tokens: a run per sequence and up to one padding run beside each, plus one.
    """
    t = md.positions.shape[0]
    rows_per_block = COMPUTE_WGS * BLOCK_Q
    padding = md.slot_mapping < 0
    md = md.replace(slot_mapping=jnp.where(padding, 0, md.slot_mapping),
                    token_seq_ids=jnp.where(padding, -1, md.token_seq_ids),
                    positions=jnp.where(padding, -1, md.positions))
    num_blocks = pl.cdiv(t, rows_per_block) + 2 * md.num_seqs + 1
    meta8, row_pos, row_tok, row_valid = query_blocks(
        md, block_q=rows_per_block, num_blocks=num_blocks, page_size=page_size, block_k=BLOCK_KV,
        pages_per_seq=pages_per_seq, sliding_window=None)
    num_rows = row_valid.sum(axis=1).astype(jnp.int32)
    zeros = jnp.zeros_like(num_rows)
    return jnp.stack([meta8[:, 0], meta8[:, 4], meta8[:, 5], row_tok[:, 0], row_pos[:, 0], num_rows, zeros, zeros],
                     axis=1)


def ragged_paged_attention(q, k_cache, v_cache, md: AttentionMetadata, *, scale: float, stages: int = STAGES):
    """``reference.ragged_paged_attention`` for the calls ``supports`` accepts (causal only)."""
    _, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_cache.shape
    if not supports(q, k_cache):
        raise ValueError(f"the Mosaic GPU prefill kernel does not take q {q.dtype}{q.shape} over pages of "
                         f"{page_size} (bf16/f16, head_dim 64 or 128, page_size a multiple of 8 dividing 128 "
                         "or a multiple of 128); the attention dispatcher sends other calls to prefill_pallas")
    group = num_heads // num_kv_heads
    num_seqs, pages_per_seq = md.block_tables.shape
    block_tables = md.block_tables.astype(jnp.int32)
    split = max(1, page_size // BLOCK_KV)
    if split > 1:  # pages of more than one key block: virtual pages of BLOCK_KV rows (a free reshape)
        page_size, num_pages, pages_per_seq = BLOCK_KV, num_pages * split, pages_per_seq * split
        k_cache = k_cache.reshape(num_kv_heads, num_pages, page_size, head_dim)
        v_cache = v_cache.reshape(num_kv_heads, num_pages, page_size, head_dim)
        block_tables = (block_tables[:, :, None] * split + jnp.arange(split, dtype=jnp.int32)).reshape(
            num_seqs, pages_per_seq)
    meta = block_schedule(md, page_size=page_size, pages_per_seq=pages_per_seq)
    num_blocks = meta.shape[0]

    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    pages_per_block = BLOCK_KV // page_size

    def entry(meta_ref, bt_ref, q_ref, k_ref, v_ref, out_ref):
        pl.run_scoped(
            lambda *scoped: _kernel(meta_ref, bt_ref, q_ref, k_ref, v_ref, out_ref, scoped, scale=float(scale),
                                    group=group, page_size=page_size, stages=stages),
            (plgpu.SMEM((COMPUTE_WGS, BLOCK_Q, head_dim), q.dtype),
             plgpu.SMEM((stages, BLOCK_KV, head_dim), q.dtype, transforms=transforms),
             plgpu.SMEM((stages, BLOCK_KV, head_dim), q.dtype, transforms=transforms)),
            # A slot is ready when its key and value pages have all landed (one arrival per page copy)
            # and free when both compute warpgroups have read its values (after its keys).
            (plgpu.Barrier(num_arrivals=2 * pages_per_block, num_barriers=stages),
             plgpu.Barrier(num_barriers=COMPUTE_WGS)),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS),
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(num_heads * num_blocks,),
        grid_names=("programs",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(meta, block_tables, q, k_cache, v_cache)


__all__ = ["block_schedule", "ragged_paged_attention", "supports"]
