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
- **PV and the next QK issued together.** After the softmax of key block ``j`` a compute warpgroup
  issues the PV matmul of block ``j`` and the QK matmul of block ``j + 1`` back to back and waits for
  both at once (``attention_mgpu`` waits for PV before it issues the next QK, and the tensor cores
  idle in between). The softmax still never runs while this warpgroup's own matmuls are in flight
  (FlashAttention-3's intra-warpgroup overlap, which runs it there, measured slower:
  docs/performance.md, "Prefill attention, Mosaic GPU kernel").
- **Two heads per program where there are programs enough.** A program may take
  ``heads_per_program`` query heads of its block one after the other. The memory warp streams the
  second head's key blocks through the same ring while the compute warpgroups finish the first, and
  each compute warpgroup prefetches its next head's query rows into its buffer: the program's start
  (launch, first loads) is paid once for both. Fewer programs balance the causal blocks' unequal
  costs worse, so ``default_heads_per_program`` pairs heads only where the pairs still fill the GPU
  six times over.
- Logits are scaled by ``scale * log2(e)`` inside the softmax (``exp2``), the queries are not.

The attention dispatcher takes this kernel on Hopper GPUs for the calls ``supports`` accepts, the
Triton kernel (``prefill_pallas``) for the rest. Its timings against cuDNN and the Triton kernel,
what each change above gained, and the variants tried and not kept are in docs/performance.md,
"Prefill attention" and "Prefill attention, Mosaic GPU kernel".
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

from jaxinfer.kernels import registry
from jaxinfer.kernels.attention.prefill_pallas import query_blocks

BLOCK_Q = 64  # query rows per compute warpgroup (one wgmma M tile)
BLOCK_KV = 128  # keys per key block
COMPUTE_WGS = 2
STAGES = 3  # key/value blocks in flight: 3 x 64 KiB with the 32 KiB query/output buffer fills shared memory
COMPUTE_REGISTERS, MEMORY_REGISTERS = 240, 24  # per thread: 2 x 128 x 240 + 128 x 24 <= 64K
MIN_WAVES_FOR_HEAD_PAIRS = 6  # measured on the H200: docs/performance.md, "Prefill attention, Mosaic GPU kernel"
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
            stages: int, heads_per_program: int):
    (qo_smem2, k_smem, v_smem), (kv_ready, q_ready), kv_free, schedule = scoped
    head_dim = q_ref.shape[-1]
    num_heads = q_ref.shape[1]
    pages_per_block = BLOCK_KV // page_size
    pages_per_seq = bt_ref.shape[1]
    dtype = q_ref.dtype
    # A program is one query block and `heads_per_program` consecutive query heads, taken one after
    # the other; head groups fastest (a KV head's query heads run side by side and share its pages
    # in L2), the longest blocks first.
    program = lax.axis_index("programs")
    head_groups = num_heads // heads_per_program
    block = lax.div(program, jnp.int32(head_groups))
    first_head = lax.rem(program, jnp.int32(head_groups)) * heads_per_program
    seq, num_kb, kv_end = meta_ref[block, 0], meta_ref[block, 1], meta_ref[block, 2]
    first_tok, first_pos, num_rows = meta_ref[block, 3], meta_ref[block, 4], meta_ref[block, 5]
    wg = lax.axis_index("wg")

    def schedule_barrier():
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        qo_smem = qo_smem2.at[wg]  # a head's query rows as loaded, later its output rows
        row0 = wg * BLOCK_Q
        rows = jnp.clip(num_rows - row0, 0, BLOCK_Q)  # this warpgroup's real rows
        pos0 = first_pos + row0  # position of its first row
        q_rows = pl.ds(first_tok + row0, BLOCK_Q)
        # Key blocks it computes: up to its last row's last visible key; the first `full` of them
        # are visible to every one of its rows (no mask).
        last_key = jnp.minimum(pos0 + jnp.maximum(rows, 1), kv_end)
        steps = jnp.where(rows > 0, lax.div(jnp.maximum(last_key, 0) + BLOCK_KV - 1, BLOCK_KV), 0)
        full = jnp.clip(lax.div(jnp.minimum(pos0 + 1, kv_end), BLOCK_KV), 0, steps)
        last = steps - 1

        def attend(item: int, q_regs):
            """One head's rows over its key blocks, which are the ring's blocks ``item * num_kb`` on.
            Returns the next head's query rows (prefetched meanwhile), or None after the last."""
            head = first_head + item
            prefetch = item + 1 < heads_per_program

            def slot_of(step):
                return lax.rem(item * num_kb + step, jnp.int32(stages))

            def issue_qk(qk_ref, step):
                plgpu.wgmma(qk_ref, q_regs, plgpu.transpose_ref(k_smem.at[slot_of(step)], (1, 0)))

            def softmax(step, acc, m_i, l_i, qk, masked: bool):
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
                schedule_barrier()  # done with the softmax; the tensor cores are free
                return acc, m_ij, l_i, p16

            def kv_step(step, carry, masked: bool):
                # The softmax of key block `step`, then its PV matmul and the next block's QK matmul
                # issued back to back: the tensor cores go from one to the other without a wait.
                acc, m_i, l_i, qk = carry
                acc, m_ij, l_i, p16 = softmax(step, acc, m_i, l_i, qk, masked)
                plgpu.barrier_wait(kv_ready.at[slot_of(step + 1)])

                def pv_qk(refs):
                    acc_ref, qk_ref = refs
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot_of(step)])
                    issue_qk(qk_ref, step + 1)
                    schedule_barrier()  # matmuls issued: the other warpgroup's softmax may end

                zeros = plgpu.layout_cast(jnp.full((BLOCK_Q, BLOCK_KV), 0, jnp.float32), plgpu.Layout.WGMMA)
                acc, qk = pl.run_state(pv_qk)((plgpu.ACC.init(acc), plgpu.ACC.init(zeros)))
                plgpu.barrier_arrive(kv_free.at[slot_of(step)])  # keys and values read
                return acc, m_ij, l_i, qk

            def first_qk():
                plgpu.barrier_wait(kv_ready.at[slot_of(0)])

                def scope(qk_ref):
                    issue_qk(qk_ref, 0)
                    schedule_barrier()
                    return qk_ref[...]

                return pl.run_scoped(scope, plgpu.ACC((BLOCK_Q, BLOCK_KV), jnp.float32))

            def last_step(carry):  # its PV has no QK after it
                acc, m_i, l_i, qk = carry
                acc, _, l_i, p16 = softmax(last, acc, m_i, l_i, qk, masked=True)

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot_of(last)])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(kv_free.at[slot_of(last)])
                return acc, l_i

            m_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((BLOCK_Q, head_dim), 0, jnp.float32), plgpu.Layout.WGMMA)
            zeros = lambda: plgpu.layout_cast(jnp.full((BLOCK_Q, BLOCK_KV), 0, jnp.float32),  # noqa: E731
                                              plgpu.Layout.WGMMA)
            qk = lax.cond(steps > 0, first_qk, zeros)
            if prefetch:  # the next head's query rows, into the buffer once the last output has left it
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.commit_smem()
                plgpu.copy_gmem_to_smem(q_ref.at[q_rows, head + 1], qo_smem, q_ready.at[wg])
            unmasked = jnp.clip(full, 0, jnp.maximum(last, 0))
            carry = lax.fori_loop(0, unmasked, functools.partial(kv_step, masked=False), (acc, m_i, l_i, qk))
            carry = lax.fori_loop(unmasked, jnp.maximum(last, 0), functools.partial(kv_step, masked=True), carry)
            acc, l_i = lax.cond(steps > 0, last_step, lambda c: (c[0], c[2]), carry)

            @pl.loop(steps, num_kb)
            def _release(step):  # key blocks only the other warpgroup's rows see
                slot = slot_of(step)  # waited for all the same: every load lands before the program ends
                plgpu.barrier_wait(kv_ready.at[slot])
                plgpu.barrier_arrive(kv_free.at[slot])
                schedule_barrier()
                schedule_barrier()

            next_q = None
            if prefetch:
                plgpu.barrier_wait(q_ready.at[wg])
                next_q = _load(qo_smem, plgpu.Layout.WGMMA)
                plgpu.commit_smem()  # every thread has read its query rows before the output lands there
            else:
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
            return next_q

        # A block starts at any token, so its query rows cannot be TMA-loaded into a tiled buffer
        # (tiles of 8 rows need an aligned start): they land untiled, and the QK matmul reads them
        # from registers, loaded once per head. (A tiled copy in shared memory measured no faster:
        # docs/performance.md, "Prefill attention, Mosaic GPU kernel".)
        plgpu.copy_gmem_to_smem(q_ref.at[q_rows, first_head], qo_smem, q_ready.at[wg])
        plgpu.barrier_wait(q_ready.at[wg])
        q_regs = _load(qo_smem, plgpu.Layout.WGMMA)
        pl.when(wg == 1)(schedule_barrier)  # the two warpgroups take the tensor cores in turn
        for item in range(heads_per_program):
            q_regs = attend(item, q_regs)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

        # One warp issues the copies: in warpgroup form each copy costs a warpgroup barrier and an
        # arrival from each of the 128 threads, and the memory warpgroup's four warps then take issue
        # slots from the compute warpgroups (measured: docs/performance.md, "Prefill attention, Mosaic
        # GPU kernel").
        @plgpu.warp_map
        def _per_warp(warp):
            @pl.when(warp == 0)
            def _():
                for item in range(heads_per_program):  # each head's key blocks, through one ring
                    kv_head = lax.div(first_head + item, jnp.int32(group))

                    @pl.loop(0, num_kb)
                    def _load(step, item=item, kv_head=kv_head):
                        ring_step = item * num_kb + step
                        slot = lax.rem(ring_step, jnp.int32(stages))

                        @pl.when(ring_step >= stages)
                        def _():  # the slot's previous key block has been read by both warpgroups
                            plgpu.barrier_wait(kv_free.at[slot])

                        for j in range(pages_per_block):
                            index = jnp.minimum(step * pages_per_block + j, pages_per_seq - 1)
                            page = jnp.maximum(bt_ref[seq, index], 0)
                            rows = pl.ds(j * page_size, page_size)
                            plgpu.copy_gmem_to_smem(k_ref.at[kv_head, page], k_smem.at[slot, rows],
                                                    kv_ready.at[slot])
                            plgpu.copy_gmem_to_smem(v_ref.at[kv_head, page], v_smem.at[slot, rows],
                                                    kv_ready.at[slot])


def default_heads_per_program(num_items: int, num_heads: int, num_sms: int) -> int:
    """Query heads a program takes in turn: 2 where the programs still fill the GPU
    ``MIN_WAVES_FOR_HEAD_PAIRS`` times over (each program then starts once for two heads, and its next
    head's key blocks stream in while the last one's finish), else 1 (few programs balance the causal
    blocks' unequal costs worse: docs/performance.md, "Prefill attention, Mosaic GPU kernel")."""
    pairs_fill = num_items // 2 >= MIN_WAVES_FOR_HEAD_PAIRS * num_sms
    return 2 if num_heads % 2 == 0 and pairs_fill else 1


def block_schedule(positions, token_seq_ids, seq_lens, *, page_size: int, pages_per_seq: int) -> jax.Array:
    """The query blocks of a step, [num_blocks, 8] int32, one row per block: (sequence, key blocks,
    end of the key range, first token, first position, tokens, 0, 0). Blocks run in reverse token
    order (the last blocks of a sequence, the longest key ranges, first); unused rows, without
    tokens, come before them.

    Padding tokens (sequence -1) become blocks of their own without keys, so that the kernel writes
    their zeros too (no pass over the output afterwards). The static block count allows one partial
    block per run of tokens: a run per sequence and up to one padding run beside each, plus one.
    """
    t = positions.shape[0]
    rows_per_block = COMPUTE_WGS * BLOCK_Q
    positions = jnp.where(token_seq_ids < 0, -1, positions)  # padding: blocks of sequence -1 without keys
    num_blocks = pl.cdiv(t, rows_per_block) + 2 * seq_lens.shape[0] + 1
    meta8, row_pos, row_tok, row_valid = query_blocks(
        positions, token_seq_ids, seq_lens, jnp.ones(t, bool), block_q=rows_per_block, num_blocks=num_blocks, page_size=page_size, block_k=BLOCK_KV,
        pages_per_seq=pages_per_seq, sliding_window=None)
    num_rows = row_valid.sum(axis=1).astype(jnp.int32)
    zeros = jnp.zeros_like(num_rows)
    return jnp.stack([meta8[:, 0], meta8[:, 4], meta8[:, 5], row_tok[:, 0], row_pos[:, 0], num_rows, zeros, zeros],
                     axis=1)


def ragged_paged_attention(q, k_cache, v_cache, positions, token_seq_ids, block_tables, seq_lens, *, scale: float,
                           stages: int = STAGES, heads_per_program: int | None = None):
    """``reference.ragged_paged_attention`` for the calls ``supports`` accepts (causal only).
    ``heads_per_program`` (a divisor of the query heads) defaults to ``default_heads_per_program``."""
    _, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_cache.shape
    if not supports(q, k_cache):
        raise ValueError(f"the Mosaic GPU prefill kernel does not take q {q.dtype}{q.shape} over pages of "
                         f"{page_size} (bf16/f16, head_dim 64 or 128, page_size a multiple of 8 dividing 128 "
                         "or a multiple of 128); the attention dispatcher sends other calls to prefill_pallas")
    group = num_heads // num_kv_heads
    num_seqs, pages_per_seq = block_tables.shape
    block_tables = block_tables.astype(jnp.int32)
    split = max(1, page_size // BLOCK_KV)
    if split > 1:  # pages of more than one key block: virtual pages of BLOCK_KV rows (a free reshape)
        page_size, num_pages, pages_per_seq = BLOCK_KV, num_pages * split, pages_per_seq * split
        k_cache = k_cache.reshape(num_kv_heads, num_pages, page_size, head_dim)
        v_cache = v_cache.reshape(num_kv_heads, num_pages, page_size, head_dim)
        block_tables = (block_tables[:, :, None] * split + jnp.arange(split, dtype=jnp.int32)).reshape(
            num_seqs, pages_per_seq)
    meta = block_schedule(positions, token_seq_ids, seq_lens, page_size=page_size, pages_per_seq=pages_per_seq)
    num_blocks = meta.shape[0]
    if heads_per_program is None:
        num_sms = registry.target_sms()
        heads_per_program = default_heads_per_program(num_blocks * num_heads, num_heads, num_sms)
    if heads_per_program < 1 or num_heads % heads_per_program:
        raise ValueError(f"heads_per_program={heads_per_program} does not divide the {num_heads} query heads")

    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    pages_per_block = BLOCK_KV // page_size

    def entry(meta_ref, bt_ref, q_ref, k_ref, v_ref, out_ref):
        pl.run_scoped(
            lambda *scoped: _kernel(meta_ref, bt_ref, q_ref, k_ref, v_ref, out_ref, scoped, scale=float(scale),
                                    group=group, page_size=page_size, stages=stages,
                                    heads_per_program=heads_per_program),
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
        grid=(num_heads // heads_per_program * num_blocks,),
        grid_names=("programs",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(meta, block_tables, q, k_cache, v_cache)


__all__ = ["block_schedule", "default_heads_per_program", "ragged_paged_attention", "supports"]
