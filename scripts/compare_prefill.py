"""The Mosaic GPU prefill kernel of another git revision next to the working tree's, in one run.

Loads ``jaxinfer/kernels/attention/prefill_mgpu.py`` as it was at ``--baseline`` and times the two
kernels (from a profiler trace: the attention kernel alone) with cuDNN's beside them, causal, d 128,
pages of 16: MHA at 4 x 4096 and 1 x 8192 tokens over 32 heads and 2 x 2048 over 16, and
Llama-3-8B's GQA (32 query heads over 8 KV heads) at 1 x 8192 and 16 x 1024; the working tree's
kernel also with one and with two heads per program forced. Each row also gives each kernel's
largest difference from the baseline's output. Two rounds, alternating.

    PYTHONPATH=. python3 scripts/compare_prefill.py --baseline HEAD~1   # writes prefill_ab.json

The baseline's kernel file runs against the working tree's package, which revisions from ``e8d7ac1``
on allow (before it the kernel took the metadata object and called ``query_blocks`` with it: the
import fails or the call does); ``compare_prefill_step.py`` compares the whole step of any revision.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import environment, kernel_breakdown, load_revision, write_json  # noqa: E402
from gpu_check import packed_sequences  # noqa: E402

from jaxinfer.kernels.attention import prefill_mgpu  # noqa: E402

KERNEL_PATH = "jaxinfer/kernels/attention/prefill_mgpu.py"
SHAPES = ((4, 4096, 32, 32), (1, 8192, 32, 32), (2, 2048, 16, 16),  # (sequences, tokens each, heads, KV heads)
          (1, 8192, 32, 8), (16, 1024, 32, 8))
PAGE_SIZE = 16


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="HEAD",
                        help="git revision of the kernel to compare against, or the folder of an exported tree")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    baseline = load_revision(KERNEL_PATH, args.baseline)
    kernels = {"before": baseline.ragged_paged_attention, "after": prefill_mgpu.ragged_paged_attention,
               "after_one_head": functools.partial(prefill_mgpu.ragged_paged_attention, heads_per_program=1),
               "after_two_heads": functools.partial(prefill_mgpu.ragged_paged_attention, heads_per_program=2)}
    num_sms = jax.devices()[0].core_count
    result = {"environment": environment(), "baseline": args.baseline, "bench": []}
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    for batch, seq_len, heads, kv_heads in SHAPES:
        flops = 4 * batch * heads * seq_len * seq_len * 128 / 2  # causal: half the square
        q, k, v, md = packed_sequences(batch, seq_len, heads, kv_heads, 128, PAGE_SIZE, jnp.bfloat16)
        dense_q = jax.random.normal(jax.random.PRNGKey(1), (batch, seq_len, heads, 128), jnp.bfloat16)
        dense_kv = dense_q[:, :, ::heads // kv_heads]  # cuDNN's keys and values: kv_heads heads (GQA)
        blocks = prefill_mgpu.block_schedule(md.positions, md.token_seq_ids, md.seq_lens, page_size=PAGE_SIZE,
                                             pages_per_seq=md.block_tables.shape[1]).shape[0]
        row = {"shape": [batch, seq_len, heads, PAGE_SIZE], "kv_heads": kv_heads, "sms": num_sms,
               "default_heads_per_program": prefill_mgpu.default_heads_per_program(blocks * heads, heads, num_sms)}
        contenders = {name: (functools.partial(fn, scale=128**-0.5), (q, k, v, *md)) for name, fn in kernels.items()}
        before = jax.jit(contenders["before"][0])(q, k, v, *md)
        for name, (fn, inputs) in contenders.items():
            row[f"{name}_vs_before_max_abs"] = float(jnp.max(jnp.abs(f32(jax.jit(fn)(*inputs)) - f32(before))))
        contenders["cudnn"] = (functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn"),
                               (dense_q, dense_kv, dense_kv))
        for _ in range(args.rounds):
            for name, (fn, inputs) in contenders.items():
                seconds = max(kernel_breakdown(fn, *inputs).values()) * 1e-6  # the attention kernel itself
                row.setdefault(f"{name}_kernel_tflops", []).append(round(flops / seconds / 1e12, 1))
        result["bench"].append(row)
        print(row, flush=True)
        write_json("prefill_ab.json", result)


if __name__ == "__main__":
    main()
