"""GPU proof for the attention kernels (and the residual add + RMSNorm kernel): parity against the
references at realistic shapes, and benchmarks next to jax's own Pallas ops, cuDNN and the ceilings
measured in the same run.

    PYTHONPATH=. python3 scripts/gpu_check.py            # writes gpu_check.json to $JAXINFER_BENCH_DIR (or .)
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import (copy_bandwidth, device_time, environment, kernel_breakdown, kernel_time,  # noqa: E402
                      matmul_rate, timer_overhead, write_json)

from jaxinfer.kernels.attention import reference  # noqa: E402
from jaxinfer.kernels.attention.decode_pallas import paged_decode_attention  # noqa: E402


def _paged_case(num_seqs, heads, kv_heads, head_dim, page_size, context, dtype, seed=0, ragged=True):
    rng = np.random.RandomState(seed)
    pages_per_seq = -(-context // page_size)
    num_pages = num_seqs * pages_per_seq
    key = jax.random.PRNGKey(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    k = jax.random.normal(k1, (kv_heads, num_pages, page_size, head_dim), dtype)
    v = jax.random.normal(k2, (kv_heads, num_pages, page_size, head_dim), dtype)
    q = jax.random.normal(k3, (num_seqs, heads, head_dim), dtype)
    tables = jnp.asarray(rng.permutation(num_pages).reshape(num_seqs, pages_per_seq), jnp.int32)
    lengths = rng.randint(1, context + 1, num_seqs) if ragged else np.full(num_seqs, context)
    return q, k, v, tables, jnp.asarray(lengths, jnp.int32)


def decode_parity():
    results = []
    cases = [
        dict(num_seqs=7, heads=32, kv_heads=8, head_dim=128, page_size=16, context=3000),
        dict(num_seqs=5, heads=16, kv_heads=1, head_dim=64, page_size=64, context=2100),
        dict(num_seqs=3, heads=8, kv_heads=8, head_dim=256, page_size=128, context=1500),
        dict(num_seqs=64, heads=64, kv_heads=8, head_dim=64, page_size=32, context=700),
        dict(num_seqs=7, heads=32, kv_heads=8, head_dim=128, page_size=16, context=3000, num_splits=1),
        dict(num_seqs=2, heads=48, kv_heads=8, head_dim=128, page_size=16, context=600, num_splits=1),
    ]
    options = {"plain": {}, "window": {"sliding_window": 300}, "softcap": {"logit_softcap": 30.0}, "sinks": "sinks"}
    for case in cases:
        tuning = {"num_splits": case["num_splits"]} if "num_splits" in case else {}  # one pass, no combine
        for dtype in (jnp.bfloat16, jnp.float32):
            q, k, v, tables, lengths = _paged_case(dtype=dtype, **{k: v for k, v in case.items() if k != "num_splits"})
            for name, extra in options.items():
                if extra == "sinks":
                    extra = {"sinks": jax.random.normal(jax.random.PRNGKey(9), (case["heads"],), jnp.float32)}
                scale = case["head_dim"] ** -0.5
                ref = reference.paged_decode_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                                       v.astype(jnp.float32), tables, lengths, scale=scale, **extra)
                out = paged_decode_attention(q, k, v, tables, lengths, scale=scale, **extra, **tuning)
                err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
                tol = 2e-2 if dtype == jnp.bfloat16 else 2e-3
                results.append({**case, "dtype": jnp.dtype(dtype).name, "options": name, "max_abs_err": err,
                                "ok": bool(err < tol)})
    return results


def rotary_checks():
    """The fused q/k norm + RoPE + cache write against its reference (parity: the rotated q and every
    cache slot), and the time of each, at Llama-3-8B and Qwen3 (q/k norm) head shapes."""
    from jaxinfer.kernels.attention.rotary_pallas import rotary_cache_write

    rows = []
    for tokens, heads, kv_heads, qk_norm in ((1, 32, 8, False), (1, 32, 4, True), (32, 32, 4, True),
                                             (8192, 32, 8, False), (8192, 32, 4, True)):
        keys = jax.random.split(jax.random.PRNGKey(tokens + heads + kv_heads), 6)
        bf = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)  # noqa: E731
        q = bf(keys[0], (tokens, heads, 128))
        k, v = bf(keys[1], (tokens, kv_heads, 128)), bf(keys[2], (tokens, kv_heads, 128))
        angles = jax.random.uniform(keys[3], (tokens, 64), jnp.float32, 0, 100)
        cos, sin = jnp.cos(jnp.concatenate([angles, angles], 1)), jnp.sin(jnp.concatenate([angles, angles], 1))
        num_pages = 2 * tokens // 16 + 4
        cache = bf(keys[4], (kv_heads, num_pages, 16, 128))
        slots = jax.random.permutation(keys[5], num_pages * 16)[:tokens].astype(jnp.int32)
        norms = dict(q_norm=1 + 0.1 * bf(keys[0], (128,)), k_norm=1 + 0.1 * bf(keys[1], (128,))) if qk_norm else {}
        want = jax.jit(reference.rotary_cache_write)(q, k, v, cos, sin, cache, cache + 1, slots, **norms)
        got = rotary_cache_write(q, k, v, cos, sin, jnp.array(cache), cache + 1, slots, **norms)
        errs = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))) for g, w in zip(got, want)]
        row = {"tokens": tokens, "heads": heads, "kv_heads": kv_heads, "qk_norm": qk_norm, "max_abs_err_q_k_v": errs,
               "ok": bool(max(errs) <= 0.0625)}  # 1 bf16 ulp at |x| < 16
        for name, fn in (("ours_us", rotary_cache_write), ("jnp_us", reference.rotary_cache_write)):
            step = lambda caches, fn=fn: fn(q, k, v, cos, sin, *caches, slots, **norms)[1:]  # noqa: E731
            row[name] = device_time(step, (cache, cache + 1), iters=20, repeats=3, unroll=10) * 1e6
        rows.append(row)
        print(row, flush=True)
    return rows


def rotary_decode_checks():
    """The fused decode step (q/k norm, RoPE, cache write and attention in the attention kernel) against
    its reference (the two ops one after the other) on the same bf16 inputs, and its kernels' time next
    to ``rotary_cache_write`` + ``paged_decode_attention``'s, at Qwen3-30B-A3B, Llama-3-8B and
    GPT-OSS-like (sinks, window, head dim 64) shapes, ragged lengths, a padding row where batched."""
    from jaxinfer.kernels.attention.decode_pallas import rotary_paged_decode_attention
    from jaxinfer.kernels.attention.rotary_pallas import rotary_cache_write

    def unfused(q, k, v, cos, sin, kc, vc, slots, tables, lengths, **options):
        norms = {name: options.pop(name) for name in ("q_norm", "k_norm") if name in options}
        q, kc, vc = rotary_cache_write(q, k, v, cos, sin, kc, vc, slots, **norms)
        return paged_decode_attention(q, kc, vc, tables, lengths, **options), kc, vc

    rows = []
    cases = [  # (sequences, heads, kv heads, head dim, context, q/k norm, options)
        (1, 32, 4, 128, 512, True, {}),
        (1, 32, 8, 128, 4096, False, {}),
        (32, 32, 4, 128, 4096, True, {}),
        (8, 64, 8, 64, 2048, False, {"sliding_window": 128, "sinks": True}),
    ]
    for num_seqs, heads, kv_heads, head_dim, context, qk_norm, options in cases:
        q, kc, vc, tables, lengths = _paged_case(num_seqs, heads, kv_heads, head_dim, 16, context, jnp.bfloat16,
                                                 seed=num_seqs + heads)
        if num_seqs > 1:  # a padding row: no tokens, no slot
            lengths = lengths.at[-1].set(0)
        keys = jax.random.split(jax.random.PRNGKey(num_seqs), 5)
        k, v = (jax.random.normal(key, (num_seqs, kv_heads, head_dim), jnp.bfloat16) for key in keys[:2])
        angles = jax.random.uniform(keys[2], (num_seqs, head_dim // 2), jnp.float32, 0, 100)
        cos, sin = jnp.cos(jnp.concatenate([angles] * 2, 1)), jnp.sin(jnp.concatenate([angles] * 2, 1))
        position = jnp.maximum(lengths - 1, 0)
        slots = jnp.where(lengths > 0, tables[jnp.arange(num_seqs), position // 16] * 16 + position % 16, -1)
        extra = dict(scale=head_dim**-0.5)
        if qk_norm:
            extra.update(q_norm=1 + 0.1 * jax.random.normal(keys[3], (head_dim,), jnp.bfloat16),
                         k_norm=1 + 0.1 * jax.random.normal(keys[4], (head_dim,), jnp.bfloat16))
        if options.get("sinks"):
            extra["sinks"] = jax.random.normal(keys[3], (heads,), jnp.float32)
        if options.get("sliding_window"):
            extra["sliding_window"] = options["sliding_window"]
        statics = {key: extra.pop(key) for key in ("scale", "sliding_window") if key in extra}
        args = (q, k, v, cos, sin)
        want = jax.jit(functools.partial(reference.rotary_paged_decode_attention, **statics))(
            *args, kc, vc, slots, tables, lengths, **extra)
        got = rotary_paged_decode_attention(*args, jnp.array(kc), jnp.array(vc), slots, tables, lengths, **extra,
                                            **statics)
        errs = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))) for g, w in zip(got, want)]
        row = {"seqs": num_seqs, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "context": context,
               "qk_norm": qk_norm, **options, "max_abs_err_out_k_v": errs,
               # the output to the decode parity's bf16 tolerance, the cache rows to 1 bf16 ulp at |x| < 16
               "ok": bool(errs[0] < 2e-2 and max(errs[1:]) <= 0.0625)}
        for name, fn in (("fused", rotary_paged_decode_attention), ("two_kernels", unfused)):
            # The output feeds the next call's q, so that no kernel's result is dead code.
            step = lambda carry, fn=fn: fn(carry[0], *args[1:], *carry[1:], slots, tables, lengths,  # noqa: E731
                                           **extra, **statics)
            row[f"{name}_us"] = device_time(step, (q, kc, vc), iters=20, repeats=3, unroll=10) * 1e6
            row[f"{name}_kernel_us"] = kernel_breakdown(
                lambda *a, fn=fn: fn(*a, **extra, **statics), *args, kc, vc, slots, tables, lengths)
        rows.append(row)
        print(row, flush=True)
    return rows


def norm_checks():
    """The residual add + RMSNorm kernel against its jnp reference (parity of the normalised output and
    of the sum, and the time of each) at the decode and prefill sizes of the benchmarked models."""
    from jaxinfer.kernels.norm import reference as norm_reference
    from jaxinfer.kernels.norm.rms_norm_pallas import add_rms_norm

    rows = []
    for tokens, hidden, residual, options in ((1, 2048, True, {}), (1, 4096, False, {}), (32, 2048, True, {}),
                                              (8192, 4096, True, {}), (7, 2880, True, {"float32_weight": True})):
        keys = jax.random.split(jax.random.PRNGKey(tokens + hidden), 3)
        x = jax.random.normal(keys[0], (tokens, hidden), jnp.float32).astype(jnp.bfloat16)
        res = jax.random.normal(keys[1], (tokens, hidden), jnp.float32).astype(jnp.bfloat16) if residual else None
        weight = (1 + 0.1 * jax.random.normal(keys[2], (hidden,), jnp.float32)).astype(jnp.bfloat16)
        want = jax.jit(functools.partial(norm_reference.add_rms_norm, eps=1e-6, **options))(x, res, weight)
        got = add_rms_norm(x, res, weight, 1e-6, **options)
        errs = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))) for g, w in zip(got, want)]
        row = {"tokens": tokens, "hidden": hidden, "residual": residual, **options, "max_abs_err_norm_sum": errs,
               "ok": bool(errs[0] <= 0.0625 and errs[1] == 0.0)}  # the norm: 1 bf16 ulp at |x| < 16
        for name, fn in (("ours", add_rms_norm), ("jnp", norm_reference.add_rms_norm)):
            step = lambda a, r, fn=fn: fn(a, r, weight, 1e-6, **options)  # noqa: E731
            row[f"{name}_us"] = device_time(lambda a, r: step(a, r)[0], x, res, iters=20, repeats=3, unroll=10) * 1e6
            row[f"{name}_kernel_us"] = kernel_time(step, x, res) * 1e6  # without the timing loop
        rows.append(row)
        print(row, flush=True)
    return rows


# (batch, context) of the decode benchmarks: 32 q / 8 kv heads, d 128, pages of 16, bf16.
DECODE_SHAPES = ((1, 4096), (32, 4096), (128, 2048))


def _decode_benchmark_case(batch, context):
    q, k, v, tables, lengths = _paged_case(batch, 32, 8, 128, 16, context, jnp.bfloat16, ragged=False)
    return (q, k, v, tables, lengths), 2 * batch * context * 8 * 128 * 2  # inputs, K+V bytes read


def decode_benchmarks(bandwidth):
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as jax_paged_attention

    rows = []
    for batch, context in DECODE_SHAPES:
        inputs, kv_bytes = _decode_benchmark_case(batch, context)
        ours_fn = functools.partial(paged_decode_attention, scale=128**-0.5)
        ours = device_time(ours_fn, *inputs, unroll=10)
        theirs = device_time(jax_paged_attention, *inputs, unroll=10)
        # The kernels' own time as well (profiler), without the timing loop's overhead.
        ours_kernels, theirs_kernels = kernel_time(ours_fn, *inputs), kernel_time(jax_paged_attention, *inputs)
        rows.append({
            "batch": batch, "context": context, "bytes": kv_bytes,
            "ours_us": ours * 1e6, "ours_bw_fraction": kv_bytes / ours / bandwidth,
            "jax_paged_attention_us": theirs * 1e6, "jax_bw_fraction": kv_bytes / theirs / bandwidth,
            "ours_kernel_us": ours_kernels * 1e6, "ours_kernel_bw_fraction": kv_bytes / ours_kernels / bandwidth,
            "jax_kernel_us": theirs_kernels * 1e6, "jax_kernel_bw_fraction": kv_bytes / theirs_kernels / bandwidth,
        })
        print(rows[-1], flush=True)
    return rows


def decode_sweep(bandwidth):
    """Block size, split count and stages around the defaults, per benchmark shape."""
    from jaxinfer.kernels.attention.decode_pallas import default_blocking

    out = []
    for batch, context in DECODE_SHAPES:
        inputs, kv_bytes = _decode_benchmark_case(batch, context)
        best = None
        for block_tokens, split_factor, stages in itertools.product((64, 128), (1, 2), (2, 3)):
            _, auto_splits = default_blocking(batch, 8, inputs[3].shape[1] * 16 // block_tokens, block_tokens, 128, 2)
            splits = max(1, int(auto_splits * split_factor))
            fn = functools.partial(paged_decode_attention, scale=128**-0.5, block_tokens=block_tokens,
                                   num_splits=splits, num_stages=stages)
            try:
                seconds = device_time(fn, *inputs, iters=20, repeats=3, unroll=10)
            except Exception as e:  # a configuration that does not fit (shared memory, registers)
                out.append({"batch": batch, "block_tokens": block_tokens, "error": str(e)[:200]})
                continue
            row = {"batch": batch, "context": context, "block_tokens": block_tokens, "num_splits": splits,
                   "num_stages": stages, "us": seconds * 1e6, "bw_fraction": kv_bytes / seconds / bandwidth}
            out.append(row)
            if best is None or row["us"] < best["us"]:
                best = row
        print("best", best, flush=True)
    return out


def split_sweep(bandwidth):
    """Few sequences, short contexts: one pass (no combine) against splitting the KV length."""
    out = []
    for batch, kv_heads, context in itertools.product((1, 4), (4, 8), (512, 1024, 2048)):
        q, k, v, tables, lengths = _paged_case(batch, 32, kv_heads, 128, 16, context, jnp.bfloat16, ragged=False)
        kv_bytes = 2 * batch * context * kv_heads * 128 * 2
        for splits in (1, 2, 4, None):
            fn = functools.partial(paged_decode_attention, scale=128**-0.5, num_splits=splits)
            seconds = device_time(fn, q, k, v, tables, lengths, iters=20, repeats=3, unroll=10)
            out.append({"batch": batch, "kv_heads": kv_heads, "context": context, "num_splits": splits or "auto",
                        "us": seconds * 1e6, "bw_fraction": kv_bytes / seconds / bandwidth})
            print(out[-1], flush=True)
    return out


def prefill_sweep(flops_rate):
    """Causal 1 x 8192 (32 heads): block sizes, stages and the page size."""
    from jaxinfer.kernels.attention.prefill_pallas import ragged_paged_attention

    out = []
    batch, seq_len, heads = 1, 8192, 32
    flops = 4 * batch * heads * seq_len * seq_len * 128 / 2
    for page_size in (16, 128):
        q, k, v, md = packed_sequences(batch, seq_len, heads, heads, 128, page_size, jnp.bfloat16)
        for (block_q, warps), block_k, stages in itertools.product(((64, 4), (128, 8)), (64, 128), (2, 3)):
            fn = functools.partial(ragged_paged_attention, scale=128**-0.5, block_q=block_q, block_k=block_k,
                                   num_warps=warps, num_stages=stages)
            try:
                seconds = device_time(fn, q, k, v, *md, iters=5, repeats=3)
            except Exception as e:
                out.append({"page_size": page_size, "block_q": block_q, "block_k": block_k, "error": str(e)[:200]})
                continue
            out.append({"page_size": page_size, "block_q": block_q, "block_k": block_k, "num_warps": warps,
                        "num_stages": stages, "tflops": flops / seconds / 1e12,
                        "fraction_of_matmul": flops / seconds / flops_rate})
        best = max((r for r in out if "tflops" in r and r["page_size"] == page_size), key=lambda r: r["tflops"])
        print("best", best, flush=True)
    return out


class Ragged(NamedTuple):
    """The ragged attention op's named arrays."""

    positions: jax.Array
    token_seq_ids: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array


def packed_sequences(batch, seq_len, heads, kv_heads, head_dim, page_size, dtype, seed=0):
    """``batch`` whole prompts of ``seq_len`` tokens packed in one ragged step."""
    key = jax.random.PRNGKey(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    pages = seq_len // page_size
    perm = np.random.RandomState(seed).permutation(batch * pages).reshape(batch, pages)
    k = jax.random.normal(k1, (kv_heads, batch * pages, page_size, head_dim), dtype)
    v = jax.random.normal(k2, (kv_heads, batch * pages, page_size, head_dim), dtype)
    q = jax.random.normal(k3, (batch * seq_len, heads, head_dim), dtype)
    positions = jnp.tile(jnp.arange(seq_len, dtype=jnp.int32), batch)
    seq_ids = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), seq_len)
    ragged = Ragged(positions, seq_ids, jnp.asarray(perm, jnp.int32), jnp.full((batch,), seq_len, jnp.int32))
    return q, k, v, ragged


def prefill_checks(flops_rate, page_sizes=(16,), parity_only=False, benchmarks_only=False):
    """Ragged prefill (the GPU default: the Mosaic GPU kernel where it applies, else the Triton one):
    parity, then causal benchmarks next to the Triton kernel, cuDNN and jax's Pallas mha, with the
    cache in pages of each of ``page_sizes`` (the dense contenders are timed again beside each).
    ``parity_only`` / ``benchmarks_only`` run one half, so parity can share the GPU with other
    correctness runs while the benchmarks have it alone."""
    from jax.experimental.pallas.ops.gpu.attention import mha as jax_mha

    from jaxinfer.kernels import attention
    from jaxinfer.kernels.attention import prefill_mgpu, prefill_pallas

    out = {"device_compute_capability": str(getattr(jax.devices()[0], "compute_capability", None)),
           "parity": [], "benchmarks": []}
    # (sequences, tokens each, heads, kv heads, head_dim, page_size, options, padding tokens after them)
    cases = ((2, 700, 32, 8, 128, 16, {}, 0), (3, 320, 4, 1, 64, 32, {}, 37), (2, 384, 4, 4, 128, 256, {}, 200),
             (3, 512, 16, 16, 64, 32, {"sliding_window": 200}, 0),
             (2, 384, 8, 2, 256, 128, {"logit_softcap": 20.0}, 0), (4, 256, 16, 1, 128, 64, {"sinks": "sinks"}, 0))
    for batch, seq_len, heads, kv_heads, head_dim, page_size, extra, pad in (() if benchmarks_only else cases):
        seq_len = seq_len // page_size * page_size
        if extra.get("sinks") == "sinks":
            extra = {"sinks": jax.random.normal(jax.random.PRNGKey(3), (heads,), jnp.float32)}
        for dtype in (jnp.bfloat16, jnp.float32):
            q, k, v, md = packed_sequences(batch, seq_len, heads, kv_heads, head_dim, page_size, dtype)
            # Chunked prefill: the last 100 tokens of each sequence are new, the rest are cached.
            keep = np.concatenate([np.arange(i * seq_len + seq_len - 100, (i + 1) * seq_len) for i in range(batch)])
            sub = md._replace(positions=md.positions[keep], token_seq_ids=md.token_seq_ids[keep])
            q = q[keep]
            if pad:  # padding tokens (sequence -1) after the real ones, as the engine packs a step
                sub = sub._replace(positions=jnp.pad(sub.positions, (0, pad)),
                                   token_seq_ids=jnp.pad(sub.token_seq_ids, (0, pad), constant_values=-1))
                q = jnp.pad(q, ((0, pad), (0, 0), (0, 0)), constant_values=1)
            scale = head_dim**-0.5
            f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
            ref = reference.ragged_paged_attention(f32(q), f32(k), f32(v), *sub, scale=scale, **extra)
            ref = jnp.where((sub.token_seq_ids >= 0)[:, None, None], ref, 0.0)  # padding tokens give zeros
            tol = 2e-2 if dtype == jnp.bfloat16 else 2e-3
            mosaic = prefill_mgpu.supports(q, k, **extra)
            # The Mosaic GPU kernel also with two heads per program, as it runs on larger steps.
            runs = {"mosaic_gpu" if mosaic else "triton": attention.ragged_paged_attention}
            if mosaic:
                runs["mosaic_gpu, 2 heads per program"] = functools.partial(prefill_mgpu.ragged_paged_attention,
                                                                            heads_per_program=2)
            for kernel, fn in runs.items():
                got = fn(q, k, v, *sub, scale=scale, **extra)
                err = float(jnp.max(jnp.abs(f32(got) - ref)))  # NaN never passes
                out["parity"].append({"batch": batch, "seq_len": seq_len, "heads": heads, "kv_heads": kv_heads,
                                      "head_dim": head_dim, "page_size": page_size, "dtype": jnp.dtype(dtype).name,
                                      "options": list(extra), "padding": pad, "kernel": kernel,
                                      "max_abs_err": err, "ok": bool(err < tol)})
    if not benchmarks_only:
        print("prefill parity ok:", all(r["ok"] for r in out["parity"]), flush=True)
    if parity_only:
        return out
    for page_size, (batch, seq_len, heads) in itertools.product(page_sizes, ((2, 2048, 16), (1, 8192, 32))):
        flops = 4 * batch * heads * seq_len * seq_len * 128 / 2  # causal: half the square
        q, k, v, md = packed_sequences(batch, seq_len, heads, heads, 128, page_size, jnp.bfloat16)
        dense_q = jax.random.normal(jax.random.PRNGKey(1), (batch, seq_len, heads, 128), jnp.bfloat16)
        contenders = {
            "ours": (functools.partial(attention.ragged_paged_attention, scale=128**-0.5), (q, k, v, *md)),
            "triton": (functools.partial(prefill_pallas.ragged_paged_attention, scale=128**-0.5), (q, k, v, *md)),
            "cudnn": (functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn"),
                      (dense_q, dense_q, dense_q)),
            "jax_pallas_mha": (functools.partial(jax_mha, segment_ids=None, causal=True), (dense_q, dense_q, dense_q)),
        }
        row = {"batch": batch, "seq_len": seq_len, "heads": heads, "page_size": page_size,
               "matmul_peak_tflops": flops_rate / 1e12}
        for name, (fn, args) in contenders.items():
            row[f"{name}_tflops"] = flops / device_time(fn, *args, iters=10) / 1e12
        # The attention kernels alone, from a trace: without the timing loop, cuDNN's memset, or our
        # block metadata (small XLA ops over the step's metadata, which XLA can share between layers).
        for name in ("ours", "cudnn"):
            kernels = kernel_breakdown(contenders[name][0], *contenders[name][1])
            row[f"{name}_kernel_us"] = kernels
            row[f"{name}_kernel_only_tflops"] = flops / (max(kernels.values()) * 1e-6) / 1e12
        row["ours_over_cudnn"] = row["ours_tflops"] / row["cudnn_tflops"]
        row["ours_over_cudnn_kernel_only"] = row["ours_kernel_only_tflops"] / row["cudnn_kernel_only_tflops"]
        out["benchmarks"].append(row)
        print({key: value for key, value in row.items() if not key.endswith("_us")}, flush=True)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--only-rotary-decode", action="store_true",
                        help="only the fused decode step's parity and times (with the ceilings)")
    parser.add_argument("--sweep", action="store_true", help="also sweep decode kernel block sizes")
    parser.add_argument("--sweep-prefill", action="store_true", help="also sweep prefill kernel block sizes")
    parser.add_argument("--prefill-parity-only", action="store_true", help="the prefill parity cases, no benchmarks")
    parser.add_argument("--prefill-benchmarks-only", action="store_true", help="the prefill benchmarks, no parity")
    parser.add_argument("--prefill-page-sizes", type=int, nargs="+", default=[16],
                        help="cache page sizes of the causal prefill benchmarks")
    parser.add_argument("--sweep-splits", action="store_true", help="also sweep decode split counts at short contexts")
    args = parser.parse_args()
    result = {"environment": environment()}
    result["copy_bandwidth_TBps"] = copy_bandwidth() / 1e12
    result["bf16_matmul_TFLOPs"] = matmul_rate() / 1e12
    result["timer_overhead_us"] = timer_overhead() * 1e6
    result["timer_overhead_unrolled_us"] = timer_overhead(unroll=10) * 1e6
    print(result, flush=True)
    if args.only_rotary_decode:
        result["rotary_decode_attention"] = rotary_decode_checks()
        print("wrote", write_json("gpu_check.json", result))
        return
    if not args.skip_decode:
        result["decode_parity"] = decode_parity()
        print("decode parity ok:", all(r["ok"] for r in result["decode_parity"]), flush=True)
        result["rotary_cache_write"] = rotary_checks()
        result["rotary_decode_attention"] = rotary_decode_checks()
        result["add_rms_norm"] = norm_checks()
        result["decode_benchmarks"] = decode_benchmarks(result["copy_bandwidth_TBps"] * 1e12)
    if args.sweep:
        write_json("gpu_check.json", result)
        result["decode_sweep"] = decode_sweep(result["copy_bandwidth_TBps"] * 1e12)
    if args.sweep_splits:
        write_json("gpu_check.json", result)
        result["split_sweep"] = split_sweep(result["copy_bandwidth_TBps"] * 1e12)
    if not args.skip_prefill:
        result["prefill"] = prefill_checks(result["bf16_matmul_TFLOPs"] * 1e12, args.prefill_page_sizes,
                                           parity_only=args.prefill_parity_only,
                                           benchmarks_only=args.prefill_benchmarks_only)
    if args.sweep_prefill:
        write_json("gpu_check.json", result)
        result["prefill_sweep"] = prefill_sweep(result["bf16_matmul_TFLOPs"] * 1e12)
    print("wrote", write_json("gpu_check.json", result))


if __name__ == "__main__":
    main()
