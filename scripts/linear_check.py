"""GPU proof for the few-row projection kernel: parity against XLA's matmuls at the real models'
shapes (also of its norm-folding form, ``norm_project``), and its kernel time next to XLA's (both
from profiler traces) and the copy bandwidth, all measured in the same run.

Timings cycle through copies of the weights, together three times the L2 cache (as a model's layers
do), so that each call reads its weights from HBM; at most 32 copies, so the router's 0.5 MB stays
partly L2-resident.

    PYTHONPATH=. python3 scripts/linear_check.py            # writes linear_check.json to $JAXINFER_BENCH_DIR (or .)
    PYTHONPATH=. python3 scripts/linear_check.py --sweep    # also the launch parameters at one row
    PYTHONPATH=. python3 scripts/linear_check.py --only-norm-parity   # norm_project's parity alone
"""

from __future__ import annotations

import functools
import math
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import copy_bandwidth, environment, kernel_time, write_json  # noqa: E402

from jaxinfer.kernels.linear import reference, skinny_pallas  # noqa: E402

# name: (out_features of the projections done together, in_features, biases)
SHAPES = {
    "qwen3-30b-a3b q/k/v": ((4096, 512, 512), 2048, False),
    "qwen3-30b-a3b o": ((2048,), 4096, False),
    "qwen3-30b-a3b router": ((128,), 2048, False),
    "llama3-8b q/k/v": ((4096, 1024, 1024), 4096, False),
    "llama3-8b o": ((4096,), 4096, False),
    "llama3-8b gate/up": ((14336, 14336), 4096, False),
    "llama3-8b down": ((4096,), 14336, False),
    "gpt-oss-20b q/k/v": ((4096, 512, 512), 2880, True),
    "gpt-oss-20b o": ((2880,), 4096, True),
}


L2_BYTES = 50 * 2**20  # H100 / H200


def make(out_features, in_features, bias, rows, dtype=jnp.bfloat16, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 2 * len(out_features) + 1)
    x = jax.random.normal(keys[0], (rows, in_features), jnp.float32).astype(dtype)
    weights = tuple((jax.random.normal(keys[1 + i], (n, in_features), jnp.float32) * in_features**-0.5).astype(dtype)
                    for i, n in enumerate(out_features))
    biases = None
    if bias:
        biases = tuple((0.1 * jax.random.normal(keys[1 + len(out_features) + i], (n,), jnp.float32)).astype(dtype)
                       for i, n in enumerate(out_features))
    return x, weights, biases


def parity():
    rows_out = []
    for name, (out_features, in_features, bias) in SHAPES.items():
        for rows in (1, 8):
            for dtype in (jnp.bfloat16, jnp.float32):
                x, weights, biases = make(out_features, in_features, bias, rows, dtype)
                with jax.default_matmul_precision("highest"):  # XLA's default for float32 is TF32
                    want = reference.project(x, weights, biases)
                got = skinny_pallas.project(x, weights, biases)
                err = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))
                                / (float(jnp.max(jnp.abs(w.astype(jnp.float32)))) + 1e-6)) for g, w in zip(got, want))
                # bf16: the two sums round differently at most a unit or two in the last place.
                ok = err < (2e-2 if dtype == jnp.bfloat16 else 1e-5)
                rows_out.append({"shape": name, "rows": rows, "dtype": jnp.dtype(dtype).name, "max_rel_err": err,
                                 "ok": ok})
                print(rows_out[-1], flush=True)
    return rows_out


def norm_parity():
    """``norm_project`` at one row for the shapes that run it (several projections after a norm)."""
    rows_out = []
    for name, (out_features, in_features, bias) in SHAPES.items():
        if len(out_features) < 2:
            continue
        for dtype in (jnp.bfloat16, jnp.float32):
            x, weights, biases = make(out_features, in_features, bias, 1, dtype)
            key_x, key_r, key_g = jax.random.split(jax.random.PRNGKey(len(name)), 3)
            x = (3 * jax.random.normal(key_x, x.shape, jnp.float32) + 0.5).astype(dtype)  # an RMS far from 1
            residual = jax.random.normal(key_r, x.shape, jnp.float32).astype(dtype)
            g = jax.random.uniform(key_g, (in_features,), jnp.float32, 0.5, 1.5).astype(dtype)
            summed = x + residual
            got = skinny_pallas.norm_project(summed, g, weights, biases, eps=1e-6)
            f32 = lambda a: None if a is None else a.astype(jnp.float32)  # noqa: E731
            with jax.default_matmul_precision("highest"):
                exact, _ = reference.norm_project(f32(summed), None, f32(g), [f32(w) for w in weights],
                                                  None if biases is None else [f32(b) for b in biases], eps=1e-6)
                rounded, _ = reference.norm_project(summed, None, g, weights, biases, eps=1e-6)

            def rel(a, b):
                return max(float(jnp.max(jnp.abs(u.astype(jnp.float32) - v.astype(jnp.float32))))
                           / (float(jnp.max(jnp.abs(v.astype(jnp.float32)))) + 1e-6) for u, v in zip(a, b))

            err, reference_err = rel(got, exact), rel(rounded, exact)
            # The kernel keeps the normalised row in float32: it must be at least as close to the exact
            # result as the reference, which rounds that row to the activations' dtype.
            ok = err <= max(reference_err, 1e-5 if dtype == jnp.float32 else 1e-2)
            rows_out.append({"shape": name, "dtype": jnp.dtype(dtype).name, "max_rel_err_vs_float32": err,
                             "reference_max_rel_err_vs_float32": reference_err, "ok": ok})
            print(rows_out[-1], flush=True)
    return rows_out


def cold_sets(out_features, in_features, bias):
    """Weight sets, together at least three times the L2 cache, and the bytes of one."""
    nbytes = sum(out_features) * in_features * 2
    count = min(32, max(1, math.ceil(3 * L2_BYTES / nbytes)))
    sets = [make(out_features, in_features, bias, 1, seed=i)[1:] for i in range(count)]
    return sets, nbytes


def cold_kernel_time(project, x, sets) -> float:
    """Kernel seconds of one ``project(x, weights, biases)``, each call on the next weight set."""
    return kernel_time(lambda x, sets: tuple(project(x, w, b) for w, b in sets), x, sets, calls=5) / len(sets)


def benchmarks(bandwidth):
    out = []
    for name, (out_features, in_features, bias) in SHAPES.items():
        sets, nbytes = cold_sets(out_features, in_features, bias)
        for rows in (1, 8, 16):
            x = make(out_features, in_features, bias, rows)[0]
            ours = cold_kernel_time(skinny_pallas.project, x, sets)
            xla = cold_kernel_time(reference.project, x, sets)
            out.append({"shape": name, "rows": rows, "weight_bytes": nbytes, "ours_us": ours * 1e6, "xla_us": xla * 1e6,
                        "ours_bw_fraction": nbytes / ours / bandwidth, "xla_bw_fraction": nbytes / xla / bandwidth,
                        "speedup": xla / ours,
                        "blocking": skinny_pallas.default_blocking(rows, in_features)._asdict()})
            print(out[-1], flush=True)
    return out


def sweep(bandwidth):
    """Launch parameters at one row."""
    Blocking = skinny_pallas.Blocking
    configs = [Blocking(n, k, 4, 3) for n in (2, 4, 8, 16) for k in (512, 1024, 2048)]
    configs += [Blocking(4, 1024, w, s) for w, s in ((4, 2), (4, 4), (8, 3), (2, 3), (4, 5))]
    out = []
    for name in ("qwen3-30b-a3b q/k/v", "qwen3-30b-a3b o", "qwen3-30b-a3b router", "llama3-8b gate/up",
                 "gpt-oss-20b q/k/v"):
        out_features, in_features, bias = SHAPES[name]
        sets, nbytes = cold_sets(out_features, in_features, bias)
        x = make(out_features, in_features, bias, 1)[0]
        for cfg in configs:
            try:
                seconds = cold_kernel_time(functools.partial(skinny_pallas.project, blocking=cfg), x, sets)
            except Exception as e:  # a configuration Triton cannot compile
                out.append({"shape": name, "blocking": cfg._asdict(), "error": str(e)[:200]})
                continue
            out.append({"shape": name, "blocking": cfg._asdict(), "us": seconds * 1e6,
                        "bw_fraction": nbytes / seconds / bandwidth})
            print(out[-1], flush=True)
    return out


def main():
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sweep", action="store_true", help="also sweep the launch parameters at one row")
    parser.add_argument("--only-norm-parity", action="store_true", help="norm_project's parity alone")
    args = parser.parse_args()
    if args.only_norm_parity:
        result = {"environment": environment(), "norm_parity": norm_parity()}
        print("wrote", write_json("linear_check_norm_parity.json", result))
        return
    result = {"environment": environment(), "copy_bandwidth_TBps": copy_bandwidth() / 1e12}
    print(result, flush=True)
    result["parity"] = parity()
    result["norm_parity"] = norm_parity()
    write_json("linear_check.json", result)
    result["benchmarks"] = benchmarks(result["copy_bandwidth_TBps"] * 1e12)
    if args.sweep:
        write_json("linear_check.json", result)
        result["sweep"] = sweep(result["copy_bandwidth_TBps"] * 1e12)
    print("wrote", write_json("linear_check.json", result))


if __name__ == "__main__":
    main()
