"""The grouped MoE MLP with quantized experts on the GPU: bf16 against fp8 (Qwen3-30B-A3B's shape,
128 x 128 scale blocks) and against MXFP4 (GPT-OSS-20B's shape), at decode sizes, against the roofline
of the bytes of the experts the step touches (copy bandwidth measured in the same run). Also the
kernel's parity with the reference (which dequantizes) and the reference's own time (a dequantized
copy of every expert per call).

    PYTHONPATH=. python3 scripts/bench_quantized_moe.py           # bench_quantized_moe.json in $JAXINFER_BENCH_DIR
    PYTHONPATH=. python3 scripts/bench_quantized_moe.py --tiny    # a CPU smoke run: tiny shapes, interpret mode
"""

from __future__ import annotations

import functools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import copy_bandwidth, device_time, environment, kernel_time, write_json  # noqa: E402

from jaxinfer.kernels.moe import grouped_pallas, reference  # noqa: E402
from jaxinfer.quantization import Fp8Weight, Mxfp4Weight  # noqa: E402

SHAPES = {
    "qwen3-30b-a3b": dict(experts=128, top_k=8, hidden=2048, inter=768, activation="silu", formats=("bf16", "fp8")),
    "gpt-oss-20b": dict(experts=32, top_k=4, hidden=2880, inter=2880, activation="gpt_oss",
                        formats=("bf16", "mxfp4")),
}
TINY_SHAPES = {
    "tiny-fp8": dict(experts=8, top_k=2, hidden=64, inter=96, activation="silu", formats=("bf16", "fp8")),
    "tiny-mxfp4": dict(experts=8, top_k=2, hidden=64, inter=96, activation="gpt_oss", formats=("bf16", "mxfp4")),
}
FP8_BLOCK = (128, 128)  # the DeepSeek / Qwen3 FP8 releases' scale blocks


def experts(fmt: str, key, e: int, n: int, k: int, block):
    """Random stacked weights ``[e, n, k]`` (about unit-variance outputs) in ``fmt``."""
    if fmt == "bf16":
        return (jax.random.normal(key, (e, n, k), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
    if fmt == "fp8":
        values = (jax.random.normal(key, (e, n, k), jnp.float32) * 8).astype(jnp.float8_e4m3fn)
        scales = jnp.full((e, -(-n // block[0]), -(-k // block[1])), k**-0.5 / 8, jnp.float32)
        return Fp8Weight(values, scales, block)
    packed = jax.random.randint(key, (e, n, k // 32, 16), 0, 256, jnp.int32).astype(jnp.uint8)
    exponent = 127 - round(math.log2(k) / 2) - 1  # values of about unit size times k ** -0.5
    return Mxfp4Weight(packed, jnp.full((e, n, k // 32), exponent, jnp.uint8))


def expert_bytes(weight) -> int:
    """The bytes of one expert's weight as stored (values and scales)."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(weight)) // weight.shape[0]


def make(shape, tokens: int, fmt: str, block, seed: int = 0):
    e, k, h, i = shape["experts"], shape["top_k"], shape["hidden"], shape["inter"]
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = jax.random.normal(keys[0], (tokens, h), jnp.bfloat16)
    weights, ids = jax.lax.top_k(jax.nn.softmax(jax.random.normal(keys[1], (tokens, e), jnp.float32)), k)
    params = dict(gate=experts(fmt, keys[2], e, i, h, block), up=experts(fmt, keys[3], e, i, h, block),
                  down=experts(fmt, keys[4], e, h, i, block))
    return x, ids.astype(jnp.int32), weights.astype(jnp.bfloat16), params


def run(shapes, token_counts, bandwidth: float, *, interpret: bool, block) -> list[dict]:
    rows = []
    for name, shape in shapes.items():
        act = shape["activation"]
        kernel = functools.partial(grouped_pallas.moe_mlp, activation=act, distinct_experts=True, interpret=interpret)
        ref = functools.partial(reference.moe_mlp, activation=act)
        for tokens in token_counts:
            for fmt in shape["formats"]:
                x, ids, weights, params = make(shape, tokens, fmt, block)
                op = lambda x, ids, weights, p, fn=kernel: fn(x, ids, weights, **p)  # noqa: E731
                out = jax.jit(op)(x, ids, weights, params).astype(jnp.float32)
                want = jax.jit(lambda x, ids, weights, p: ref(x, ids, weights, **p))(x, ids, weights, params)
                err = float(jnp.max(jnp.abs(out - want.astype(jnp.float32))) / (jnp.max(jnp.abs(want)) + 1e-6))
                touched = len(np.unique(np.asarray(ids)))
                moved = touched * sum(expert_bytes(w) for w in params.values())
                iters = 3 if interpret else 20
                ours = device_time(op, x, ids, weights, params, iters=iters, repeats=2 if interpret else 5,
                                   unroll=1 if interpret else 10)
                row = {"shape": name, "tokens": tokens, "format": fmt, "max_rel_err": err,
                       "touched_experts": touched, "expert_bytes": moved, "ours_us": ours * 1e6,
                       "bw_fraction": moved / ours / bandwidth}
                if not interpret:
                    # The kernels' own time (profiler), without the timing loop's overhead; and the
                    # reference's, which writes a dequantized copy of every expert first.
                    seconds = kernel_time(op, x, ids, weights, params)
                    row.update(kernel_us=seconds * 1e6, kernel_bw_fraction=moved / seconds / bandwidth,
                               reference_us=device_time(lambda x, ids, weights, p: ref(x, ids, weights, **p),
                                                        x, ids, weights, params, iters=5) * 1e6)
                rows.append(row)
                print(row, flush=True)
    return rows


def main():
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes in interpret mode (a CPU smoke run)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32], help="token counts")
    args = parser.parse_args()
    if args.tiny:
        a = jnp.ones((1 << 22,), jnp.float32)
        bandwidth = 2 * a.nbytes / device_time(lambda x: x * 2, a, iters=3, repeats=2)
        shapes, block, name = TINY_SHAPES, (32, 32), "bench_quantized_moe_tiny.json"
    else:
        bandwidth, shapes, block, name = copy_bandwidth(), SHAPES, FP8_BLOCK, "bench_quantized_moe.json"
    result = {"environment": environment(), "copy_bandwidth_TBps": bandwidth / 1e12, "fp8_block": list(block)}
    print(result, flush=True)
    result["rows"] = run(shapes, args.tokens, bandwidth, interpret=args.tiny, block=block)
    print("wrote", write_json(name, result))


if __name__ == "__main__":
    main()
