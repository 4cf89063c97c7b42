"""The decode attention kernel of another git revision next to the working tree's, in one run.

Loads ``jaxinfer/kernels/attention/decode_pallas.py`` as it was at ``--baseline`` (a module of its
own, so both versions compile side by side) and times both at the benchmark shapes plus short
contexts, then the working tree's kernel at a few launch options around its defaults. A change to
the kernel is judged by this comparison, made in one process on one GPU, not against numbers from
another day.

    PYTHONPATH=. python3 scripts/compare_decode.py --baseline HEAD~1   # writes compare_decode.json
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import copy_bandwidth, device_time, environment, load_revision, write_json  # noqa: E402
from gpu_check import _paged_case  # noqa: E402

from jaxinfer.kernels.attention import decode_pallas  # noqa: E402

KERNEL_PATH = "jaxinfer/kernels/attention/decode_pallas.py"
# (batch, context, kv heads) with 32 query heads, d 128, pages of 16: the gpu_check shapes, then the
# short contexts of a batch-1 decode step (Qwen3-30B-A3B has 4 KV heads).
SHAPES = ((1, 4096, 8), (32, 4096, 8), (128, 2048, 8), (1, 512, 4), (1, 512, 8), (1, 2048, 4))
VARIANTS = (  # the working tree's kernel with launch options around the defaults
    (1, 4096, 8, dict(block_tokens=64)), (1, 4096, 8, dict(num_warps=8)), (1, 512, 4, dict(block_tokens=128)),
    (32, 4096, 8, dict(block_tokens=128)), (32, 4096, 8, dict(num_stages=2)), (32, 4096, 8, dict(num_stages=4)),
    (128, 2048, 8, dict(num_stages=2)), (128, 2048, 8, dict(block_tokens=128)),
)


def time_kernel(module, inputs, kv_bytes, bandwidth, **options):
    fn = functools.partial(module.paged_decode_attention, scale=128**-0.5, **options)
    seconds = device_time(fn, *inputs, iters=50, repeats=5, unroll=10)
    return {"us": seconds * 1e6, "bw_fraction": kv_bytes / seconds / bandwidth}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="HEAD",
                        help="git revision of the kernel to compare against, or the folder of an exported tree")
    args = parser.parse_args()
    baseline = load_revision(KERNEL_PATH, args.baseline)
    bandwidth = copy_bandwidth()
    result = {"environment": environment(), "baseline": args.baseline, "copy_bandwidth_TBps": bandwidth / 1e12,
              "shapes": [], "variants": []}
    cases = [(shape, {}) for shape in SHAPES] + [(variant[:3], variant[3]) for variant in VARIANTS]
    for (batch, context, kv_heads), options in cases:
        inputs = _paged_case(batch, 32, kv_heads, 128, 16, context, jnp.bfloat16, ragged=False)
        kv_bytes = 2 * batch * context * kv_heads * 128 * 2
        row = {"batch": batch, "context": context, "kv_heads": kv_heads, **options,
               "current": time_kernel(decode_pallas, inputs, kv_bytes, bandwidth, **options)}
        if not options:
            row["baseline"] = time_kernel(baseline, inputs, kv_bytes, bandwidth)
            ours = decode_pallas.paged_decode_attention(*inputs, scale=128**-0.5)
            theirs = baseline.paged_decode_attention(*inputs, scale=128**-0.5)
            row["max_abs_diff"] = float(jnp.max(jnp.abs(ours.astype(jnp.float32) - theirs.astype(jnp.float32))))
        result["variants" if options else "shapes"].append(row)
        print(row, flush=True)
    print("wrote", write_json("compare_decode.json", result))


if __name__ == "__main__":
    main()
