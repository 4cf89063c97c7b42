r"""fp8 projections on the GPU, each next to its ceiling measured in the same run.

Decode (``--batches``, default 1 and 32): Llama-3-8B's projection sets (q/k/v, o, gate/up, down) with
fp8 weights in blocks of 128 x 128 and with bf16 weights, each as ``linear.project`` serves it on
the GPU (fp8: the few-row kernel up to 16 rows, else dequantize + XLA's matmul; bf16: the kernel
for several projections of one row, else XLA), and forced through the few-row kernel (up to 16
rows) and through the reference. The roofline is the bytes read (the weights as stored: e4m3 values
and float32 scales, or bf16; x; the outputs) over the copy bandwidth. At one row the fp8 kernel is
also swept over weight rows per program (``--block-ns``).

Prefill (``--tokens``, default 8192): the gate/up and down shapes as fp8 x fp8 GEMMs (x quantized per
token and 128 columns): the Pallas kernel (x's quantization included, and alone), the reference
(XLA's fp8 dot per column group); the default path with fp8 weights (dequantize + XLA's bf16
matmul); a bf16 XLA matmul; and a plain fp8 matmul peak (one ``dot_general`` of e4m3 inputs over
the whole reduction, float32 result): TFLOP/s of each.

Each kernel's outputs are also compared with its reference's (``*_max_rel_err``: the largest
difference over the largest reference magnitude). Times are the GPU's kernel time from a profiler
trace (``benchlib.kernel_time``). ``--scale-down N``
divides every width by N (blocks down to 32), runs the Pallas kernels interpreted on the CPU and
times by the wall clock: a smoke run of the script, not a benchmark.

    PYTHONPATH=. python3 scripts/bench_fp8.py                                    # bench_fp8.json in $JAXINFER_BENCH_DIR
    PYTHONPATH=. python3 scripts/bench_fp8.py --scale-down 32 --tokens 64 --batches 1 32   # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import copy_bandwidth, device_time, environment, kernel_time, write_json  # noqa: E402

from jaxinfer.kernels import linear as linear_ops  # noqa: E402
from jaxinfer.kernels import registry  # noqa: E402
from jaxinfer.kernels.linear import fp8, reference, skinny_pallas  # noqa: E402
from jaxinfer.quantization import Fp8Weight  # noqa: E402

HIDDEN, Q, KV, MLP = 4096, 4096, 1024, 14336  # Llama-3-8B
BLOCK = 128


def projection_sets(scale_down: int) -> dict[str, list[tuple[int, int]]]:
    """Llama-3-8B's projections of one input each, ``[(out, in), ...]``, every width divided by ``scale_down``."""
    h, q, kv, mlp = (n // scale_down for n in (HIDDEN, Q, KV, MLP))
    return {"qkv": [(q, h), (kv, h), (kv, h)], "o": [(h, q)], "gate_up": [(mlp, h), (mlp, h)], "down": [(h, mlp)]}


def random_fp8(key, out_features: int, in_features: int, block: int) -> Fp8Weight:
    values = (jax.random.normal(key, (out_features, in_features), jnp.float32) * 64).astype(fp8.E4M3)
    scales = jax.random.uniform(key, (-(-out_features // block), -(-in_features // block)), jnp.float32, 1e-4, 2e-4)
    return Fp8Weight(values, scales, (block, block))


def random_bf16(key, out_features: int, in_features: int):
    return (jax.random.normal(key, (out_features, in_features), jnp.float32) * in_features**-0.5).astype(jnp.bfloat16)


def weight_bytes(w) -> int:
    return w.values.nbytes + w.scales.nbytes if fp8.is_fp8(w) else w.nbytes


def wall_time(fn, *args, repeats: int = 3) -> float:
    """Median seconds per call by the wall clock (the smoke run's stand-in for ``kernel_time``)."""
    run = jax.jit(fn)
    jax.block_until_ready(run(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timed(timer, fn, *args, forced: dict | None = None) -> float | str:
    """Seconds per call of ``fn(*args)`` (traced with ``forced`` implementations), or the error."""
    try:
        with registry.force(forced) if forced else contextlib.nullcontext():
            return timer(fn, *args)
    except Exception as e:  # noqa: BLE001  (one failed variant must not end the run)
        return f"{type(e).__name__}: {str(e)[:300]}"


def max_rel_err(fn, want_fn, *args, forced: dict) -> float | str:
    """The largest difference of ``fn(*args)`` (traced with ``forced``) from ``want_fn(*args)`` over
    the largest magnitude of the latter (both flattened over their outputs), or the error."""
    try:
        with registry.force(forced):
            got = jax.jit(fn)(*args)
        want = jax.jit(want_fn)(*args)
        diffs = [jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32))) for g, w in
                 zip(jax.tree.leaves(got), jax.tree.leaves(want))]
        scale = max(float(jnp.max(jnp.abs(w.astype(jnp.float32)))) for w in jax.tree.leaves(want))
        return max(float(d) for d in diffs) / scale
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:300]}"


def _us(seconds):
    return seconds * 1e6 if isinstance(seconds, float) else seconds


def bench_decode(args, timer, bandwidth: float, block: int) -> list[dict]:
    rows = []
    for batch in args.batches:
        for name, shapes in projection_sets(args.scale_down).items():
            keys = jax.random.split(jax.random.PRNGKey(batch), len(shapes) + 1)
            x = jax.random.normal(keys[0], (batch, shapes[0][1]), jnp.float32).astype(jnp.bfloat16)
            weights = {"fp8": [random_fp8(k, n, c, block) for k, (n, c) in zip(keys[1:], shapes)],
                       "bf16": [random_bf16(k, n, c) for k, (n, c) in zip(keys[1:], shapes)]}
            io_bytes = x.nbytes + sum(batch * n * 2 for n, _ in shapes)
            row = {"batch": batch, "projections": name, "shapes": shapes}
            for kind, ws in weights.items():
                read = sum(weight_bytes(w) for w in ws) + io_bytes
                roofline = read / bandwidth
                row[f"{kind}_bytes"], row[f"{kind}_roofline_us"] = read, roofline * 1e6
                variants = {"op": None, "reference": {"linear.project": "reference"}}
                if batch <= skinny_pallas.MAX_ROWS:
                    variants["skinny"] = {"linear.project": "skinny"}
                for variant, forced in variants.items():
                    # A function of its own per variant: a traced program is cached per function.
                    project = lambda x, ws: linear_ops.project(x, ws)  # noqa: E731
                    seconds = timed(timer, project, x, ws, forced=forced)
                    row[f"{kind}_{variant}_us"] = _us(seconds)
                    if isinstance(seconds, float):
                        row[f"{kind}_{variant}_roofline_fraction"] = roofline / seconds
            if batch <= skinny_pallas.MAX_ROWS:
                row["fp8_skinny_max_rel_err"] = max_rel_err(lambda x, ws: linear_ops.project(x, ws), reference.project,
                                                            x, weights["fp8"], forced={"linear.project": "skinny"})
            if isinstance(row.get("fp8_op_us"), float) and isinstance(row.get("bf16_op_us"), float):
                row["fp8_speedup_over_bf16"] = row["bf16_op_us"] / row["fp8_op_us"]
            if batch == 1:
                sweep = {}
                block_k = fp8.aligned_block_k(weights["fp8"], skinny_pallas.default_blocking(1, shapes[0][1]).block_k)
                for block_n in args.block_ns:
                    blocking = skinny_pallas.Blocking(block_n, block_k, 4, 3)
                    fn = lambda x, ws, b=blocking: skinny_pallas.project(x, ws, blocking=b,  # noqa: E731
                                                                         interpret=args.interpret)
                    sweep[f"block_n={block_n},block_k={blocking.block_k}"] = _us(timed(timer, fn, x, weights["fp8"]))
                row["fp8_skinny_sweep_us"] = sweep
            rows.append(row)
            print(row, flush=True)
    return rows


def bench_prefill(args, timer, block: int) -> list[dict]:
    rows = []
    h, mlp = HIDDEN // args.scale_down, MLP // args.scale_down
    for name, (n, k) in {"gate": (mlp, h), "down": (h, mlp)}.items():
        keys = jax.random.split(jax.random.PRNGKey(n + k), 2)
        x = jax.random.normal(keys[0], (args.tokens, k), jnp.float32).astype(jnp.bfloat16)
        w = random_fp8(keys[1], n, k, block)
        w_bf16 = random_bf16(keys[1], n, k)
        x_fp8, _ = fp8.quantize_activations(x, block)
        flops = 2 * args.tokens * n * k
        dims = (((1,), (1,)), ((), ()))
        variants = {
            "fp8_gemm_kernel": (lambda x, w: linear_ops.fp8_gemm(x, w), (x, w), {"linear.fp8_gemm": "triton"}),
            "fp8_gemm_reference": (reference.fp8_gemm, (x, w), None),
            "activation_quantization": (lambda x: fp8.quantize_activations(x, block), (x,), None),
            "fp8_weights_dequantize_then_bf16": (lambda x, w: linear_ops.project(x, [w])[0], (x, w), None),
            "bf16": (lambda x, w: jax.lax.dot_general(x, w, dims), (x, w_bf16), None),
            "fp8_peak": (lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32),
                         (x_fp8, w.values), None),
        }
        row = {"tokens": args.tokens, "projection": name, "out_features": n, "in_features": k, "flops": flops,
               "fp8_gemm_kernel_max_rel_err": max_rel_err(lambda x, w: linear_ops.fp8_gemm(x, w), reference.fp8_gemm,
                                                          x, w, forced={"linear.fp8_gemm": "triton"})}
        for variant, (fn, fn_args, forced) in variants.items():
            seconds = timed(timer, fn, *fn_args, forced=forced)
            row[f"{variant}_us"] = _us(seconds)
            if isinstance(seconds, float) and variant != "activation_quantization":
                row[f"{variant}_TFLOPs"] = flops / seconds / 1e12
        rows.append(row)
        print(row, flush=True)
    return rows


def small_copy_bandwidth() -> float:
    """Bytes/s of ``a * 2`` over 64 MiB of float32 (a smoke run's stand-in for ``copy_bandwidth``)."""
    a = jnp.ones((16, 1024, 1024), jnp.float32)
    return 2 * a.size * 4 / device_time(lambda x: x * 2, a, iters=5, repeats=3)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=8192, help="prefill rows")
    parser.add_argument("--block-ns", type=int, nargs="+", default=[4, 8, 16, 32],
                        help="weight rows per program of the one-row fp8 sweep")
    parser.add_argument("--scale-down", type=int, default=1, metavar="N",
                        help="divide every width by N and run the kernels interpreted on the CPU: a smoke run")
    args = parser.parse_args()
    smoke = args.scale_down > 1
    args.interpret = smoke
    block = max(32, BLOCK // args.scale_down)
    result = {"environment": environment(), "block": [block, block], "smoke_run": smoke,
              "scale_down": args.scale_down}
    timer = wall_time if smoke else kernel_time
    with registry.targeting(registry.Target.interpreted()) if smoke else contextlib.nullcontext():
        result["copy_bandwidth_TBps"] = (small_copy_bandwidth() if smoke else copy_bandwidth()) / 1e12
        result["decode"] = bench_decode(args, timer, result["copy_bandwidth_TBps"] * 1e12, block)
        write_json("bench_fp8.json", result)
        result["prefill"] = bench_prefill(args, timer, block)
    print("wrote", write_json("bench_fp8.json", result))


if __name__ == "__main__":
    main()
