"""The linear-attention recurrences on the CPU: the chunked jnp form against the token-by-token
reference, both jitted, at one sequence of T tokens (the speed-up chunking buys where no kernel runs).

    PYTHONPATH=. python3 scripts/bench_linear_cpu.py --tokens 1024 --heads 32 --dim 128 [--json OUT]

Prints one JSON line per op: median / min milliseconds over the repeats after a warm-up call.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np


def _inputs(ops: str, t: int, h: int, d: int, seed: int = 0):
    rng = np.random.RandomState(seed)
    unit = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
    q = jnp.asarray(unit(rng.randn(t, h, d)) * d ** -0.5, jnp.float32)
    k = jnp.asarray(unit(rng.randn(t, h, d)), jnp.float32)
    v = jnp.asarray(rng.randn(t, h, d), jnp.float32)
    cu = jnp.asarray([0, t], jnp.int32)
    state = jnp.zeros((1, h, d, d), jnp.float32)
    beta = jnp.asarray(rng.rand(t, h), jnp.float32)
    if ops == "gated_delta":
        return q, k, v, jnp.asarray(-rng.rand(t, h) * 0.1, jnp.float32), beta, cu, state
    if ops == "kda":
        return q, k, v, jnp.asarray(-rng.rand(t, h, d) * 0.1, jnp.float32), beta, cu, state
    slope = jnp.asarray(0.5 ** (8 / h * (np.arange(h) + 1)), jnp.float32)
    return q, k, v, slope, cu, state


def _forms(ops: str):
    if ops == "gated_delta":
        from jaxinfer.kernels.gated_delta import chunked, reference
        return reference.gated_delta_rule, chunked.gated_delta_rule
    if ops == "kda":
        from jaxinfer.kernels.kda import chunked, reference
        return reference.kda, chunked.kda
    from jaxinfer.kernels.lightning import chunked, reference
    return reference.lightning_attention, chunked.lightning_attention


def _time(fn, args, repeats: int) -> tuple[float, float, float]:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3, float(np.min(times)) * 1e3, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ops", nargs="+", default=["gated_delta", "kda", "lightning"])
    parser.add_argument("--json", help="also append the results to this file")
    args = parser.parse_args()
    for ops in args.ops:
        inputs = _inputs(ops, args.tokens, args.heads, args.dim)
        row = dict(op=ops, tokens=args.tokens, heads=args.heads, dim=args.dim, device=jax.devices()[0].device_kind)
        for name, fn in zip(("reference", "chunked"), _forms(ops)):
            median, best, first = _time(jax.jit(fn), inputs, args.repeats)
            row.update({f"{name}_median_ms": round(median, 2), f"{name}_min_ms": round(best, 2),
                        f"{name}_first_call_s": round(first, 2)})
        row["speedup"] = round(row["reference_median_ms"] / row["chunked_median_ms"], 2)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
