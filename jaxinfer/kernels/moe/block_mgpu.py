"""One token's whole MoE block as one persistent Pallas Mosaic GPU kernel (Hopper: TMA, WGMMA, clusters).

Same semantics as ``reference.moe_block``: the residual add, the RMSNorm, the router projection,
softmax top-k routing with renormalised weights, the experts' SiLU-gated MLPs scaled by the routing
weights, summed. It serves a decode step of one sequence, whose MoE block the engine's kernels run
as five launches (add + norm, router projection, routing, gate + up, down) that each wait for the
one before; ``fits`` says which shapes it takes (Qwen3-30B-A3B's), ``device_fits`` where.

**Grid.** 66 clusters of 2 CTAs, one CTA per SM of an H200 (132). Each CTA has a producer
warpgroup that streams 16 KB weight tiles (64 rows x 128 columns) through a ring of shared-memory
slots by TMA, and a consumer warpgroup that multiplies each tile (WGMMA's ``A``) with the
activation in row 0 of an 8-row ``B`` tile, and releases the slot. Cluster rank ``r`` takes the
k-tiles ``[8 r, 8 r + 8)`` of a 2048-wide row.

**Phases** (every hand-off between clusters is a flagged word, ``mgpu_inline``):

- every CTA adds the attention output and the residual, computes the row's RMS and writes its half
  of the normalised row into its ``B`` tiles;
- clusters 0-1: the router's 128 logits (64 each; rank 1's sums go to rank 0 through distributed
  shared memory), published as bf16;
- every CTA: the routing (each thread ranks one logit by counting larger keys: the bf16 bits made
  order-preserving, ties to the lower index as ``lax.top_k``), then it releases its producer, which
  only now knows which experts' tiles to load;
- gate + up: 192 items of (slot, 32-row block), cluster ``c`` taking items ``c, c + 66, c + 132``; a
  ring slot holds an item's 32 gate rows and its 32 up rows (two TMA boxes); rank 0 applies
  SiLU(gate) * up and publishes the item's 32 activations;
- down: output row block ``b`` on clusters ``2b`` and ``2b + 1``, CTA ``q = 2 (c % 2) + r`` of the
  four taking slots ``2q, 2q + 1``; each slot's sums are rounded and scaled by its bf16 routing
  weight; the odd cluster's float32 sums meet the even cluster's through 64 flagged words, and the
  even cluster's rank 0 writes the row block's output and residual.

Every CTA must be resident (the CTAs wait on each other): ``device_fits`` asks for a Hopper GPU of 132
SMs and a program on that one device; the kernel assumes no other process holds SMs. A wait gives up
after about a second (``mgpu_inline.SPIN_LIMIT``) rather than hang the GPU, and every CTA publishes
a status word: ``timed_out`` reads them, and the op reports a call where any wait gave up (or any CTA
never ran) as a fault of the model call (``jaxinfer.kernels.context``), whose outputs the engine
then discards. The flag (an int32 unique to the call among calls that may reuse its buffers, in
word 0 of ``flag_words``) marks this call's words. A call also writes the next call's flag words
(the flag plus one), so a chain of calls (a step's layers) runs no op of its own to make its flags.

**Outputs.** The block's output stream ``h + out`` (rounded as XLA rounds that add), which the next
layer takes as its input with no residual apart, so no add runs between the layers; its parts, the
MoE output ``out`` and ``h = attn_out + residual``, for checks; the next flag; the status words.
The measurements behind this design: docs/performance.md, "MoE block kernel".
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxinfer.kernels import mgpu_inline as mi
from jaxinfer.kernels import pdl

HIDDEN, NUM_EXPERTS, TOP_K, INTERMEDIATE = 2048, 128, 8, 768
NUM_SMS = 132
R, KC, XN = 64, 128, 8  # weight tile rows and columns, B tile rows
NCL, CL = 66, 2
HK = HIDDEN // KC // CL  # 8 k-tiles a CTA of a 2048-wide row
IT = INTERMEDIATE // KC  # 6 k-tiles of a down row block per expert
GU_BLOCKS = INTERMEDIATE // 32  # 24 items a slot
GU_ITEMS = TOP_K * GU_BLOCKS  # 192
MAX_ITEMS = -(-GU_ITEMS // NCL)  # 3
ROUTER_CLUSTERS = NUM_EXPERTS // R  # 2
OUT_BLOCKS = HIDDEN // R  # 32
DOWN_CLUSTERS = 2 * OUT_BLOCKS  # 64
ACT_WORDS = INTERMEDIATE // 2  # a slot's activation words
MB_ROUTER, MB_DOWN = MAX_ITEMS, MAX_ITEMS + 1  # mbarriers: gate/up items 0-2, router, down
FLAG_WORDS = 32  # a call's flag in word 0 (one TMA copy)
SLOTS = 9  # ring slots
FLIGHT = 4  # tiles in flight a CTA (r14: 4 slightly faster than 6)


def fits(x, gate, up, down, router_weight, *, top_k: int, router: str, norm_topk_prob: bool, activation: str,
         has_biases: bool) -> bool:
    """Whether the call has the kernel's shapes and semantics: one token, Qwen3-30B-A3B's shapes,
    bf16, softmax top-8 with renormalised weights, SiLU, no biases."""
    if x.shape != (1, HIDDEN) or x.dtype != jnp.bfloat16:
        return False
    if gate.shape != (NUM_EXPERTS, INTERMEDIATE, HIDDEN) or up.shape != gate.shape:
        return False
    if down.shape != (NUM_EXPERTS, HIDDEN, INTERMEDIATE) or router_weight.shape != (NUM_EXPERTS, HIDDEN):
        return False
    if any(a.dtype != jnp.bfloat16 for a in (gate, up, down, router_weight)):
        return False
    return (top_k, router, norm_topk_prob, activation, has_biases) == (TOP_K, "softmax_topk", True, "silu", False)


def device_fits(target) -> bool:
    """A Hopper GPU of 132 SMs (``jaxinfer.kernels.registry.Target``): every CTA resident at once,
    and no mesh of several devices to partition the kernel over."""
    return target.hopper and target.sm_count == NUM_SMS and target.mesh_size == 1


# ---------------------------------------------------------------------------- PTX pieces
def _route_top8(logit_words, keys, ids, wts):
    """The 128 bf16 logits in ``logit_words`` (64 int32 words) -> the top-8 expert ids (``ids``, best
    first, ties to the lower index) and their softmax weights renormalised over the 8, rounded to
    bf16 (``wts``, float32): ``reference.route`` then ``moe_mlp``'s rounding of the weights.

    Thread t ranks logit t by counting the logits above it; each logit's key is unique (its bf16
    bits made order-preserving as unsigned, -0 as +0, then 127 - index in the low byte)."""
    def body(lw, ky, ix, wt):
        mi.ptx(f"""{{
            .reg .u32 t, b, o, s, a;
            .reg .b16 h;
            .reg .pred p;
            {mi.thread_index()}
            mad.lo.u32 a, t, 2, $0;
            ld.shared.b16 h, [a];
            cvt.u32.u16 b, h;
            setp.eq.u32 p, b, 0x8000;
            @p mov.u32 b, 0;
            and.b32 s, b, 0x8000;
            setp.ne.u32 p, s, 0;
            not.b32 o, b;
            and.b32 o, o, 0xFFFF;
            or.b32 s, b, 0x8000;
            selp.b32 o, o, s, p;
            shl.b32 o, o, 8;
            sub.u32 s, 127, t;
            or.b32 o, o, s;
            mad.lo.u32 a, t, 4, $1;
            st.shared.u32 [a], o;
        }}""", [mi.addr32(lw), mi.addr32(ky)], "r,r")
        mi.wg_barrier()
        count = " ".join(f"ld.shared.v4.u32 {{k0, k1, k2, k3}}, [$1 + {16 * j}];"
                         + "".join(f" set.gt.u32.u32 d, k{i}, me; sub.u32 rk, rk, d;" for i in range(4))
                         for j in range(NUM_EXPERTS // 4))
        mi.ptx(f"""{{
            .reg .u32 t, a, me, rk, d, k0, k1, k2, k3;
            .reg .b16 h;
            .reg .f32 x;
            .reg .pred p;
            {mi.thread_index()}
            mad.lo.u32 a, t, 4, $1;
            ld.shared.u32 me, [a];
            mov.u32 rk, 0;
            {count}
            setp.lt.u32 p, rk, {TOP_K};
            @!p bra END${{:uid}};
            mad.lo.u32 a, rk, 4, $2;
            st.shared.u32 [a], t;
            mad.lo.u32 a, t, 2, $0;
            ld.shared.b16 h, [a];
            cvt.f32.bf16 x, h;
            mad.lo.u32 a, rk, 4, $3;
            st.shared.f32 [a], x;
        END${{:uid}}:
        }}""", [mi.addr32(lw), mi.addr32(ky), mi.addr32(ix), mi.addr32(wt)], "r,r,r,r")
        mi.wg_barrier()
        # threads 0-7: exp(logit - max) of all 8 (the max is slot 0's), summed in slot order, own / sum
        exps = " ".join(f"ld.shared.f32 x, [$0 + {4 * j}]; sub.rn.f32 x, x, m; mul.rn.f32 x, x, 0f{mi.LOG2E};"
                        f" ex2.approx.f32 x, x; add.rn.f32 s, s, x; setp.eq.u32 p, t, {j}; @p mov.f32 own, x;"
                        for j in range(TOP_K))
        mi.ptx(f"""{{
            .reg .u32 t, a;
            .reg .b16 h;
            .reg .f32 m, x, s, own;
            .reg .pred p;
            {mi.thread_index()}
            setp.lt.u32 p, t, {TOP_K};
            @!p bra END${{:uid}};
            ld.shared.f32 m, [$0];
            mov.f32 s, 0f00000000;
            mov.f32 own, 0f00000000;
            {exps}
            div.rn.f32 own, own, s;
            {mi.bf16_round("own", "own")}
            bar.warp.sync 0xff;
            mad.lo.u32 a, t, 4, $0;
            st.shared.f32 [a], own;
        END${{:uid}}:
        }}""", [mi.addr32(wt)], "r")
        mi.wg_barrier()
    mi.inline((mi.PLAIN,) * 4, body)(logit_words, keys, ids, wts)


def _down_partial(raw, wts, out):
    """This CTA's two slots: ``raw`` (2, 64) float32 sums, each rounded to bf16, scaled by its slot's
    weight (``wts``: the two slots' weights), rounded again, then added into ``out`` (64 float32)."""
    def body(rw, wt, ou):
        mi.wg_barrier()  # raw is stored
        mi.ptx(f"""{{
            .reg .u32 t, a;
            .reg .b16 h;
            .reg .f32 x, y, wa, wb;
            .reg .pred act;
            {mi.thread_index()}
            setp.lt.u32 act, t, 64;
            @!act bra END${{:uid}};
            ld.shared.f32 wa, [$1];
            ld.shared.f32 wb, [$1 + 4];
            mad.lo.u32 a, t, 4, $0;
            ld.shared.f32 x, [a];
            ld.shared.f32 y, [a + 256];
            {mi.bf16_round("x", "x")} {mi.bf16_round("y", "y")}
            mul.rn.f32 x, x, wa; {mi.bf16_round("x", "x")}
            mul.rn.f32 y, y, wb; {mi.bf16_round("y", "y")}
            add.rn.f32 x, x, y;
            mad.lo.u32 a, t, 4, $2;
            st.shared.f32 [a], x;
        END${{:uid}}:
        }}""", [mi.addr32(rw), mi.addr32(wt), mi.addr32(ou)], "r,r,r")
        mi.wg_barrier()
    mi.inline((mi.PLAIN,) * 3, body)(raw, wts, out)


def _store_output(own, recv, h_smem, out_gmem, h_gmem, stream_gmem):
    """The even down cluster's rank 0: its 64 sums plus rank 1's and the odd cluster's (``recv``
    rows 0 and 1), rounded to bf16, to ``out_gmem``; the row block's residual (``h_smem``, bf16) to
    ``h_gmem``; their sum, rounded to bf16 as XLA rounds an add of the two, to ``stream_gmem``."""
    def body(ow, rc, hs, og, hg, sg):
        mi.wg_barrier()  # own is stored
        mi.ptx(f"""{{
            .reg .u32 t, a, b;
            .reg .u64 p, q;
            .reg .b16 h;
            .reg .f32 x, z;
            .reg .pred act;
            {mi.thread_index()}
            setp.lt.u32 act, t, 64;
            @!act bra END${{:uid}};
            mad.lo.u32 a, t, 4, $0;
            mad.lo.u32 b, t, 4, $1;
            ld.shared.f32 x, [a];
            ld.shared.f32 z, [b]; add.rn.f32 x, x, z;
            ld.shared.f32 z, [b + 256]; add.rn.f32 x, x, z;
            cvt.rn.bf16.f32 h, x;
            mul.wide.u32 p, t, 2;
            add.u64 q, p, $3;
            st.global.b16 [q], h;
            cvt.f32.bf16 x, h;
            mad.lo.u32 a, t, 2, $2;
            ld.shared.b16 h, [a];
            add.u64 q, p, $4;
            st.global.b16 [q], h;
            cvt.f32.bf16 z, h;
            add.rn.f32 x, x, z;
            cvt.rn.bf16.f32 h, x;
            add.u64 q, p, $5;
            st.global.b16 [q], h;
        END${{:uid}}:
        }}""", [mi.addr32(ow), mi.addr32(rc), mi.addr32(hs), mi.addr64(og), mi.addr64(hg), mi.addr64(sg)],
            "r,r,r,l,l,l")
        mi.wg_barrier()
    mi.inline((mi.PLAIN,) * 6, body)(own, recv, h_smem, out_gmem, h_gmem, stream_gmem)


def _next_flag(flag_smem, next_gmem):
    """Word 0 of the next call's flag words: this call's flag (``flag_smem``, as passed) plus 1. One
    thread stores it; the other words are not read."""
    def body(fs, ng):
        mi.ptx(f"""{{
            .reg .u32 t, v;
            .reg .pred z;
            {mi.thread_index()}
            setp.eq.u32 z, t, 0;
            @!z bra END${{:uid}};
            ld.shared.u32 v, [$0];
            add.u32 v, v, 1;
            st.global.u32 [$1], v;
        END${{:uid}}:
        }}""", [mi.addr32(fs), mi.addr64(ng)], "r,l")
    mi.inline((mi.PLAIN,) * 2, body)(flag_smem, next_gmem)


# ------------------------------------------------------------------------------------ kernel
def _kernel(attn_ref, res_ref, norm_ref, router_ref, gate_ref, up_ref, down_ref, flag_ref,
            out_ref, h_ref, stream_ref, next_flag_ref, logit_ll, act_ll, part_ll, status_ref, scoped, *, eps: float,
            trigger: bool, stale_router_words: bool):
    (ring, full, empty, routed, tiles_x, tiles_a, tiles_b, xvec, raw, part, gu_recv, r_recv, d_recv, lw, keys,
     ids_s, wts_s, ints, mbar, scratch, flag_s, bars, cbar) = scoped
    c = lax.axis_index("sm")
    rank = lax.axis_index("cl")
    wg = lax.axis_index("wg")
    is_router = c < ROUTER_CLUSTERS
    is_down = c < DOWN_CLUSTERS
    block = c // 2  # the down row block
    quarter = 2 * lax.rem(c, 2) + rank  # which two slots of it
    n_items = (GU_ITEMS - c + NCL - 1) // NCL
    router_tiles = jnp.where(is_router, HK, 0)
    if trigger:  # the next kernel's CTAs are placed while this one runs
        mi.launch_dependents()

    @pl.when(wg == 1)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def issue(n, copy):
            """Tile n into ring slot n % SLOTS once that slot is free and tile n - FLIGHT landed."""
            slot = lax.rem(n, SLOTS)

            @pl.when(n >= SLOTS)
            def _():
                plgpu.barrier_wait(empty.at[slot])

            @pl.when(n >= FLIGHT)
            def _():
                plgpu.barrier_wait(full.at[lax.rem(n - FLIGHT, SLOTS)])
            copy(ring.at[slot], full.at[slot])

        def two_boxes(top, bottom):
            """A tile as two TMA boxes of 32 rows (every slot's barrier expects two arrivals)."""
            def copy(dst, bar):
                plgpu.copy_gmem_to_smem(top, dst.at[pl.ds(0, 32)], bar)
                plgpu.copy_gmem_to_smem(bottom, dst.at[pl.ds(32, 32)], bar)
            return copy

        @pl.when(is_router)
        def _():
            def router(i, _):
                cols = pl.ds((rank * HK + i) * KC, KC)
                issue(i, two_boxes(router_ref.at[pl.ds(c * R, 32), cols], router_ref.at[pl.ds(c * R + 32, 32), cols]))
            lax.fori_loop(0, HK, router, None)
        plgpu.barrier_wait(routed.at[0])  # the ids are in ids_s

        def gate_up(n, _):
            item = c + n * NCL
            e = ids_s[item // GU_BLOCKS]
            rows = pl.ds(lax.rem(item, GU_BLOCKS) * 32, 32)

            def tile(i, _):
                cols = pl.ds((rank * HK + i) * KC, KC)
                issue(router_tiles + n * HK + i, two_boxes(gate_ref.at[e, rows, cols], up_ref.at[e, rows, cols]))
            lax.fori_loop(0, HK, tile, None)
        lax.fori_loop(0, n_items, gate_up, None)
        first = router_tiles + n_items * HK

        @pl.when(is_down)
        def _():
            for s in range(2):
                e = ids_s[2 * quarter + s]

                def d(i, _):
                    cols = pl.ds(i * KC, KC)
                    issue(first + s * IT + i, two_boxes(down_ref.at[e, pl.ds(block * R, 32), cols],
                                                        down_ref.at[e, pl.ds(block * R + 32, 32), cols]))
                lax.fori_loop(0, IT, d, None)

    @pl.when(wg == 0)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        plgpu.copy_gmem_to_smem(flag_ref, flag_s, bars.at[0])
        plgpu.barrier_wait(bars.at[0])
        ints[0] = mi.flag_with_high_bit(flag_s[0])
        ints[1] = jnp.int32(0)  # this CTA's status: set to 1 by a wait that gives up

        @pl.when((c == 0) & (rank == 0))
        def _():
            _next_flag(flag_s, next_flag_ref)
        mi.init_mbarriers(mbar, (1,) * (MAX_ITEMS + 2))
        plgpu.barrier_arrive(cbar.at[0])  # the peer sends only once the barriers exist
        plgpu.barrier_wait(cbar.at[0])
        flag = ints.at[pl.ds(0, 1)]
        status = ints.at[pl.ds(1, 1)]

        def tile_sum(first, count, b_smem):
            """Column 0 of the WGMMAs of ring tiles first .. first + count - 1 against ``b_smem``."""
            def scoped_acc(acc_ref):
                def step(i, _):
                    slot = lax.rem(first + i, SLOTS)
                    plgpu.barrier_wait(full.at[slot])
                    plgpu.wgmma(acc_ref, ring.at[slot], b_smem.at[i].T)
                    plgpu.wgmma_wait(1)

                    @pl.when(i >= 1)
                    def _():
                        plgpu.barrier_arrive(empty.at[lax.rem(first + i - 1, SLOTS)])
                lax.fori_loop(0, count, step, None)
                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(empty.at[lax.rem(first + count - 1, SLOTS)])
                return acc_ref[...]
            acc = pl.run_scoped(scoped_acc, plgpu.ACC((R, XN), jnp.float32))
            col = lax.broadcasted_iota(jnp.int32, (R, XN), 1)
            return jnp.where(col == 0, acc, jnp.zeros_like(acc)).sum(axis=1)

        def pair_sum(vec, mb, recv, finish):
            """Rank 1 sends ``vec`` into rank 0's ``recv`` row 0; rank 0 keeps its own in ``part``,
            waits, and runs ``finish``."""
            bar = mbar.at[pl.ds(2 * mb, 2)]

            @pl.when(rank == 1)
            def _():
                recv.at[0][...] = vec
                mi.send_words(recv.at[0], bar, R * 4, 0)

            @pl.when(rank == 0)
            def _():
                part[...] = vec
                mi.wait_mbarrier(bar, 0, status)
                finish()

        mi.add_rows(attn_ref, res_ref, xvec)
        mi.rms_norm_half_to_tiles(xvec, norm_ref.at[pl.ds(rank * (HIDDEN // 2), HIDDEN // 2)], tiles_x, scratch, eps)
        plgpu.commit_smem()

        router_flag = flag
        if stale_router_words:  # a test of the status word: every wait for the logits gives up
            ints[2] = ints[0] + 1
            router_flag = ints.at[pl.ds(2, 1)]

        @pl.when(is_router)
        def _router():
            pair_sum(tile_sum(0, HK, tiles_x), MB_ROUTER, r_recv, lambda: mi.sum_publish(
                "bf16", part, r_recv, logit_ll.at[pl.ds(c * (R // 2), R // 2)], router_flag, nrecv=1))

        mi.ll_poll(logit_ll, lw, flag, status, NUM_EXPERTS // 2, mi.PLAIN)
        _route_top8(lw, keys, ids_s, wts_s)
        plgpu.barrier_arrive(routed.at[0])

        def gate_up(n, _):
            item = c + n * NCL
            pair_sum(tile_sum(router_tiles + n * HK, HK, tiles_x), n, gu_recv.at[n], lambda: mi.sum_publish(
                "silu_mul", part, gu_recv.at[n], act_ll.at[pl.ds(item * 16, 16)], flag, nrecv=1))
        lax.fori_loop(0, n_items, gate_up, None)
        first = router_tiles + n_items * HK

        @pl.when(is_down)
        def _down():
            for s, tiles in enumerate((tiles_a, tiles_b)):
                mi.ll_poll(act_ll.at[pl.ds((2 * quarter + s) * ACT_WORDS, ACT_WORDS)], tiles, flag, status, ACT_WORDS,
                           mi.TILE_T, mi.b_tile_offset)
            plgpu.commit_smem()
            raw.at[0][...] = tile_sum(first, IT, tiles_a)
            raw.at[1][...] = tile_sum(first + IT, IT, tiles_b)
            _down_partial(raw, wts_s.at[pl.ds(2 * quarter, 2)], raw.at[0])
            vec = plgpu.load(raw.at[0], (), layout=plgpu.Layout.WGMMA.reduce(1))

            def finish():
                @pl.when(lax.rem(c, 2) == 1)
                def _():
                    mi.sum_publish("f32", part, d_recv, part_ll.at[block], flag, nrecv=1)

                @pl.when(lax.rem(c, 2) == 0)
                def _():
                    mi.ll_poll(part_ll.at[block], d_recv.at[1], flag, status, R, mi.PLAIN)
                    rows = pl.ds(block * R, R)
                    _store_output(part, d_recv, xvec.at[rows], out_ref.at[rows], h_ref.at[rows], stream_ref.at[rows])
            pair_sum(vec, MB_DOWN, d_recv, finish)

        mi.publish_status(flag, status, status_ref.at[pl.ds(c * CL + rank, 1)])


@functools.lru_cache(maxsize=None)
def _build(eps: float, trigger: bool, stale_router_words: bool = False):
    def entry(*refs):
        pl.run_scoped(
            lambda scoped: _kernel(*refs, scoped, eps=eps, trigger=trigger,
                                   stale_router_words=stale_router_words),
            (plgpu.SMEM((SLOTS, R, KC), jnp.bfloat16, transforms=mi.TILED),  # ring
             plgpu.Barrier(num_arrivals=2, num_barriers=SLOTS),  # full: two TMA boxes a tile
             plgpu.Barrier(num_arrivals=1, num_barriers=SLOTS),  # empty
             plgpu.Barrier(num_arrivals=1, num_barriers=1),  # routed: the consumer to its producer
             plgpu.SMEM((HK, XN, KC), jnp.bfloat16, transforms=mi.TILED),  # B: the normed row's half
             plgpu.SMEM((IT, XN, KC), jnp.bfloat16, transforms=mi.TILED),  # B: slot 2q's activations
             plgpu.SMEM((IT, XN, KC), jnp.bfloat16, transforms=mi.TILED),  # B: slot 2q + 1's
             plgpu.SMEM((HIDDEN,), jnp.bfloat16),  # the residual stream (attention output + residual)
             plgpu.SMEM((2, R), jnp.float32),  # down: the two slots' sums
             plgpu.SMEM((R,), jnp.float32),  # rank 0's own sums
             plgpu.SMEM((MAX_ITEMS, 1, R), jnp.float32),  # gate/up: rank 1's sums per item
             plgpu.SMEM((1, R), jnp.float32),  # router: rank 1's sums
             plgpu.SMEM((2, R), jnp.float32),  # down: rank 1's sums, the odd cluster's
             plgpu.SMEM((NUM_EXPERTS // 2,), jnp.int32),  # the logits' words
             plgpu.SMEM((NUM_EXPERTS,), jnp.int32),  # their keys
             plgpu.SMEM((TOP_K,), jnp.int32),  # expert ids
             plgpu.SMEM((TOP_K,), jnp.float32),  # weights
             plgpu.SMEM((4,), jnp.int32),  # the flag
             plgpu.SMEM((2 * (MAX_ITEMS + 2),), jnp.int32),  # mbarriers
             plgpu.SMEM((4,), jnp.float32),  # per-warp sums
             plgpu.SMEM((FLAG_WORDS,), jnp.int32),  # the flag words
             plgpu.Barrier(num_barriers=1),
             plgpu.ClusterBarrier(collective_axes=("cl",), num_barriers=1)),
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((HIDDEN,), jnp.bfloat16),  # the MoE output
                  jax.ShapeDtypeStruct((HIDDEN,), jnp.bfloat16),  # h: attention output + residual
                  jax.ShapeDtypeStruct((HIDDEN,), jnp.bfloat16),  # the block's output stream, h + MoE output
                  jax.ShapeDtypeStruct((FLAG_WORDS,), jnp.int32),  # the next call's flag words
                  jax.ShapeDtypeStruct((NUM_EXPERTS // 2, 2), jnp.int32),  # logit words
                  jax.ShapeDtypeStruct((TOP_K * ACT_WORDS, 2), jnp.int32),  # activation words
                  jax.ShapeDtypeStruct((OUT_BLOCKS, R, 2), jnp.int32),  # the odd clusters' down sums
                  jax.ShapeDtypeStruct((NUM_SMS, 2), jnp.int32)),  # each CTA's status word
        grid=(NCL,),
        grid_names=("sm",),
        cluster=(CL,),
        cluster_names=("cl",),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )


class BlockOutputs(NamedTuple):
    stream: jax.Array  # [1, H] the block's output: h + out (the next layer's input, no residual apart)
    next_flag: jax.Array  # [FLAG_WORDS] int32, the next call's flag words
    out: jax.Array  # [1, H] the MoE output
    residual: jax.Array  # [1, H] h = attn_out + residual
    status: jax.Array  # [NUM_SMS, 2] int32: each CTA's (status, flag) word; see ``timed_out``


def flag_words(flag):
    """An int32 flag -> the ``[FLAG_WORDS]`` int32 words a call takes (the flag in word 0)."""
    return jnp.zeros((FLAG_WORDS,), jnp.int32).at[0].set(jnp.asarray(flag, jnp.int32))


def timed_out(outputs: BlockOutputs, flag) -> jax.Array:
    """[NUM_SMS] bool: CTAs whose call went wrong: one of its waits gave up, or its status word does
    not carry this call's flag (the CTA never ran). ``flag``: the call's flag words."""
    expected = mi.flag_with_high_bit(jnp.asarray(flag, jnp.int32)[0])
    return (outputs.status[:, 0] != 0) | (outputs.status[:, 1] != expected)


def moe_block(attn_out, residual, norm_weight, router_weight, gate, up, down, flag, *, eps: float,
              stale_router_words: bool = False) -> BlockOutputs:
    """``reference.moe_block`` with softmax top-8 routing and renormalised weights, plus its parts.
    ``flag``: ``flag_words`` of an int32 unique to the call (see the module docstring); the call
    returns the next call's, the flag plus one, so that a chain of blocks (a step's layers) needs no
    op of its own to make each one's. Check ``timed_out`` before trusting the outputs.
    ``stale_router_words`` (tests of that check): the router's words carry another call's flag, so
    every wait for them gives up."""
    semantics = dict(top_k=TOP_K, router="softmax_topk", norm_topk_prob=True, activation="silu", has_biases=False)
    if not fits(attn_out, gate, up, down, router_weight, **semantics) or residual.shape != attn_out.shape \
            or norm_weight.shape != (HIDDEN,):
        raise ValueError(
            f"the one-token MoE block kernel does not take attn_out {attn_out.dtype}{attn_out.shape}, residual "
            f"{residual.shape}, norm weight {norm_weight.shape}, gate/up {gate.dtype}{gate.shape}/{up.shape}, down "
            f"{down.shape}, router {router_weight.shape} (one bf16 token; {NUM_EXPERTS} experts of {INTERMEDIATE} "
            f"over hidden {HIDDEN}); moe.moe_block sends other calls to the block's ops")
    if flag is None:
        raise ValueError("the one-token MoE block kernel needs a flag unique to the call (e.g. the step id times the "
                         "layer count plus the layer): its hand-off words would otherwise pass for a later call's")
    if jnp.shape(flag) != (FLAG_WORDS,) or jnp.result_type(flag) != jnp.int32:
        raise ValueError(f"the one-token MoE block kernel takes its flag as {FLAG_WORDS} int32 words "
                         f"(block_mgpu.flag_words(flag)), not {jnp.result_type(flag)}{jnp.shape(flag)}")
    kernel = _build(float(eps), pdl.triggers_at_start("moe_block"), stale_router_words)
    out, h, stream, next_flag, _, _, _, status = kernel(attn_out.reshape(HIDDEN), residual.reshape(HIDDEN),
                                                        norm_weight, router_weight, gate, up, down, flag)
    return BlockOutputs(stream.reshape(1, HIDDEN), next_flag, out.reshape(1, HIDDEN), h.reshape(1, HIDDEN), status)
