"""GPU proof for the MoE kernels: parity against the reference at real shapes, and benchmarks of the
grouped GEMM next to XLA's ragged_dot, jax's Mosaic GPU ragged_dot_mgpu, the dense matmul rate and the
copy bandwidth, all measured in the same run; the routing kernel against the jnp router it replaces.

    PYTHONPATH=. python3 scripts/moe_check.py             # writes moe_check.json to $JAXINFER_BENCH_DIR (or .)
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import (copy_bandwidth, device_time, environment, kernel_breakdown, kernel_time, matmul_rate,  # noqa: E402
                      timer_overhead, write_json)

from jaxinfer.kernels.moe import reference  # noqa: E402
from jaxinfer.kernels.moe import grouped_pallas, grouping, grouping_pallas, router_pallas  # noqa: E402

SHAPES = {
    "qwen3-30b-a3b": dict(experts=128, top_k=8, hidden=2048, inter=768, activation="silu", bias=False),
    "gpt-oss-20b": dict(experts=32, top_k=4, hidden=2880, inter=2880, activation="gpt_oss", bias=True),
}


def make(shape, tokens, dtype=jnp.bfloat16, seed=0):
    e, k, h, i = shape["experts"], shape["top_k"], shape["hidden"], shape["inter"]
    keys = jax.random.split(jax.random.PRNGKey(seed), 8)
    x = jax.random.normal(keys[0], (tokens, h), dtype)
    logits = jax.random.normal(keys[1], (tokens, e), jnp.float32)
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits), k)
    w = lambda key, s: (jax.random.normal(key, s, jnp.float32) * s[-1] ** -0.5).astype(dtype)  # noqa: E731
    params = dict(gate=w(keys[2], (e, i, h)), up=w(keys[3], (e, i, h)), down=w(keys[4], (e, h, i)))
    if shape["bias"]:
        params.update(gate_bias=w(keys[5], (e, i)) * 0.1, up_bias=w(keys[6], (e, i)) * 0.1,
                      down_bias=w(keys[7], (e, h)) * 0.1)
    return x, ids.astype(jnp.int32), weights.astype(dtype), params


def parity(token_counts=(1, 8, 64, 4096)):
    rows = []
    for name, shape in SHAPES.items():
        for tokens in token_counts:
            x, ids, weights, params = make(shape, tokens)
            ref = reference.moe_mlp(x.astype(jnp.float32), ids, weights.astype(jnp.float32),
                                    **{k: v.astype(jnp.float32) for k, v in params.items()},
                                    activation=shape["activation"])
            out = grouped_pallas.moe_mlp(x, ids, weights, **params, activation=shape["activation"],
                                         distinct_experts=True)
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / (jnp.max(jnp.abs(ref)) + 1e-6))
            row = {"shape": name, "tokens": tokens, "max_rel_err": err, "ok": bool(err < 3e-2)}
            if tokens * shape["top_k"] > grouped_pallas.DECODE_ROWS:  # prefill: the grouping kernels, exactly
                block_m = grouped_pallas.default_block_sizes(tokens, shape["top_k"], shape["experts"], shape["hidden"],
                                                             shape["inter"])["block_m"]
                want = grouping.group_by_expert(ids, shape["experts"], block_m)
                got = grouping_pallas.group_by_expert(ids, shape["experts"], block_m)
                row["grouping_equal"] = all(bool(jnp.array_equal(a, b)) for a, b in zip(want, got))
                row["ok"] = row["ok"] and row["grouping_equal"]
            rows.append(row)
            print(rows[-1], flush=True)
    return rows


ROUTERS = {  # the routers of the real models, at their expert counts
    "qwen3-30b-a3b": dict(router="softmax_topk", top_k=8, experts=128),
    "gpt-oss-20b": dict(router="topk_softmax", top_k=4, experts=32),
    "minimax-m2": dict(router="sigmoid_bias", top_k=8, experts=256, routed_scaling_factor=1.0),
}


def router_check():
    """The routing kernel against ``reference.route``: same expert ids, weights to float32 rounding,
    and the time of each (jnp: softmax, a sort for top-k, the normalisation)."""
    rows = []
    for name, cfg in ROUTERS.items():
        options = {k: v for k, v in cfg.items() if k != "experts"}
        for tokens in (1, 8, 64, 4096):
            keys = jax.random.split(jax.random.PRNGKey(tokens), 2)
            logits = jax.random.normal(keys[0], (tokens, cfg["experts"]), jnp.float32).astype(jnp.bfloat16)
            bias = 0.1 * jax.random.normal(keys[1], (cfg["experts"],), jnp.float32)
            if cfg["router"] == "sigmoid_bias":
                options["correction_bias"] = bias
            ref_w, ref_ids = reference.route(logits, **options)
            w, ids = router_pallas.route(logits, **options)
            same_ids = bool(jnp.all(ids == ref_ids))
            err = float(jnp.max(jnp.abs(w - ref_w)))
            run = lambda fn: lambda x: fn(x, **options)[0].sum().astype(x.dtype) + x  # noqa: E731
            ours = device_time(run(router_pallas.route), logits, iters=20, unroll=10)
            jnp_router = device_time(run(reference.route), logits, iters=20, unroll=10)
            rows.append({"router": name, "tokens": tokens, "same_ids": same_ids, "max_abs_weight_err": err,
                         "ok": same_ids and err < 1e-5, "ours_us": ours * 1e6, "jnp_us": jnp_router * 1e6})
            print(rows[-1], flush=True)
    return rows


def benchmarks(bandwidth, flops_rate, token_counts=(1, 8, 64, 4096)):
    rows = []
    for name, shape in SHAPES.items():
        act = shape["activation"]
        for tokens in token_counts:
            x, ids, weights, params = make(shape, tokens)
            op = lambda x, ids, weights, p: grouped_pallas.moe_mlp(x, ids, weights, **p, activation=act,  # noqa: E731
                                                                   distinct_experts=True)
            ours = device_time(op, x, ids, weights, params, iters=20, unroll=1 if tokens >= 1024 else 10)
            row = {"shape": name, "tokens": tokens, "ours_us": ours * 1e6}
            if tokens >= 1024:
                flops = 2 * tokens * shape["top_k"] * shape["hidden"] * shape["inter"] * 3
                xla = device_time(lambda x, ids, weights, p: reference.moe_mlp(x, ids, weights, **p, activation=act),
                                  x, ids, weights, params, iters=5)
                row.update(ours_tflops=flops / ours / 1e12, xla_ragged_dot_tflops=flops / xla / 1e12,
                           dense_matmul_tflops=flops_rate / 1e12, fraction_of_dense=flops / ours / flops_rate)
                row.update(_mgpu(shape, x, ids, params, flops))
                row["kernels_us"] = kernel_breakdown(op, x, ids, weights, params)  # where the op's time goes
            else:
                touched = len(np.unique(np.asarray(ids)))
                expert_bytes = touched * 3 * shape["hidden"] * shape["inter"] * 2
                # Also the op's kernel time alone (profiler): at microseconds the timing loop's
                # own overhead is a visible share of ours_us.
                kernel = kernel_time(op, x, ids, weights, params)
                row.update(touched_experts=touched, bytes=expert_bytes,
                           bw_fraction=expert_bytes / ours / bandwidth, kernel_us=kernel * 1e6,
                           kernel_bw_fraction=expert_bytes / kernel / bandwidth)
            rows.append(row)
            print(row, flush=True)
    return rows


def _mgpu(shape, x, ids, params, flops):
    """jax's Mosaic GPU ragged_dot doing the three bare matmuls on rows already sorted by expert."""
    try:
        from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import ragged_dot
    except ImportError as e:
        return {"mgpu_error": str(e)}
    flat = ids.reshape(-1)
    order = jnp.argsort(flat)
    rows = x[order // ids.shape[1]]
    sizes = jnp.bincount(flat, length=shape["experts"]).astype(jnp.int32)
    cfg = dict(block_m=128, block_n=128 if shape["inter"] % 128 == 0 else 64, block_k=64, max_concurrent_steps=4,
               grid_block_n=1, transpose_rhs=True)
    down_cfg = dict(cfg, block_n=128 if shape["hidden"] % 128 == 0 else 64)

    def three(r, p):
        g = ragged_dot(r, p["gate"], group_sizes=sizes, **cfg)
        u = ragged_dot(r, p["up"], group_sizes=sizes, **cfg)
        return ragged_dot(jax.nn.silu(g) * u, p["down"], group_sizes=sizes, **down_cfg)

    try:
        seconds = device_time(three, rows, {k: params[k] for k in ("gate", "up", "down")}, iters=10)
    except Exception as e:  # unsupported shape for that kernel
        return {"mgpu_error": str(e)[:300]}
    return {"mgpu_bare_matmuls_tflops": flops / seconds / 1e12}


def prefill_sweep(flops_rate):
    """4096 tokens: launch parameters of each kernel (the other at its default), and block_m."""
    from jaxinfer.kernels.moe.grouped_pallas import KernelTuning

    gate_up = [KernelTuning(64, 64, 8, 3), KernelTuning(64, 64, 4, 4), KernelTuning(128, 64, 8, 3),
               KernelTuning(128, 64, 8, 4), KernelTuning(128, 32, 8, 4), KernelTuning(64, 128, 8, 2)]
    down = [KernelTuning(128, 64, 8, 3), KernelTuning(128, 64, 4, 4), KernelTuning(256, 64, 8, 3),
            KernelTuning(128, 128, 8, 2), KernelTuning(128, 64, 8, 4), KernelTuning(64, 64, 4, 4)]
    rows = []
    for name, shape in SHAPES.items():
        act = shape["activation"]
        x, ids, weights, params = make(shape, 4096)
        flops = 2 * 4096 * shape["top_k"] * shape["hidden"] * shape["inter"] * 3
        configs = [dict(gate_up_tuning=g) for g in gate_up] + [dict(down_tuning=d) for d in down]
        configs += [dict(block_m=64), dict(block_m=64, gate_up_tuning=KernelTuning(128, 64, 8, 3))]
        for cfg in configs:
            fn = lambda x, ids, w, p, cfg=cfg: grouped_pallas.moe_mlp(x, ids, w, **p, activation=act, distinct_experts=True,  # noqa: E731
                                                                       **cfg)
            try:
                seconds = device_time(fn, x, ids, weights, params, iters=10, repeats=3)
            except Exception as e:
                rows.append({"shape": name, "config": repr(cfg), "error": str(e)[:200]})
                continue
            rows.append({"shape": name, "config": repr(cfg), "tflops": flops / seconds / 1e12,
                         "fraction_of_dense": flops / seconds / flops_rate})
            print(rows[-1], flush=True)
    return rows


def decode_sweep(bandwidth):
    """1 and 8 tokens: launch parameters of each kernel at decode sizes (the other at its default),
    by kernel time, each kernel's own time listed."""
    from jaxinfer.kernels.moe.grouped_pallas import KernelTuning as T

    configs = [{}, dict(down_tuning=T(64, 128, 4, 4)), dict(down_tuning=T(32, 128, 2, 4)),
               dict(down_tuning=T(32, 256, 4, 3)), dict(gate_up_tuning=T(64, 128, 4, 4)),
               dict(gate_up_tuning=T(32, 256, 4, 3)),
               dict(down_tuning=T(64, 128, 4, 4), gate_up_tuning=T(64, 128, 4, 4))]
    rows = []
    for name, shape in SHAPES.items():
        act = shape["activation"]
        for tokens in (1, 8):
            x, ids, weights, params = make(shape, tokens)
            expert_bytes = len(np.unique(np.asarray(ids))) * 3 * shape["hidden"] * shape["inter"] * 2
            for cfg in configs:
                fn = lambda x, ids, w, p, cfg=cfg: grouped_pallas.moe_mlp(x, ids, w, **p, activation=act, distinct_experts=True,  # noqa: E731
                                                                       **cfg)
                try:
                    kernels = kernel_breakdown(fn, x, ids, weights, params)
                except Exception as e:  # a configuration Triton cannot compile
                    rows.append({"shape": name, "tokens": tokens, "config": repr(cfg), "error": str(e)[:200]})
                    continue
                seconds = sum(kernels.values()) * 1e-6
                rows.append({"shape": name, "tokens": tokens, "config": repr(cfg), "kernel_us": seconds * 1e6,
                             "kernel_bw_fraction": expert_bytes / seconds / bandwidth, "kernels_us": kernels})
                print(rows[-1], flush=True)
    return rows


def main():
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sweep", action="store_true", help="also sweep the prefill launch parameters")
    parser.add_argument("--sweep-decode", action="store_true", help="also sweep the decode launch parameters")
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--bench-tokens", type=int, nargs="+", default=[1, 8, 64, 4096],
                        help="token counts of the benchmarks")
    parser.add_argument("--parity-tokens", type=int, nargs="+", default=[1, 8, 64, 4096],
                        help="token counts of the parity cases")
    args = parser.parse_args()
    result = {"environment": environment(), "copy_bandwidth_TBps": copy_bandwidth() / 1e12,
              "bf16_matmul_TFLOPs": matmul_rate() / 1e12, "timer_overhead_unrolled_us": timer_overhead(unroll=10) * 1e6}
    print(result, flush=True)
    if not args.skip_parity:
        result["parity"] = parity(args.parity_tokens)
        write_json("moe_check.json", result)
    result["router"] = router_check()
    write_json("moe_check.json", result)
    result["benchmarks"] = benchmarks(result["copy_bandwidth_TBps"] * 1e12, result["bf16_matmul_TFLOPs"] * 1e12,
                                      args.bench_tokens)
    if args.sweep_decode:
        write_json("moe_check.json", result)
        result["decode_sweep"] = decode_sweep(result["copy_bandwidth_TBps"] * 1e12)
    if args.sweep:
        write_json("moe_check.json", result)
        result["prefill_sweep"] = prefill_sweep(result["bf16_matmul_TFLOPs"] * 1e12)
    print("wrote", write_json("moe_check.json", result))


if __name__ == "__main__":
    main()
