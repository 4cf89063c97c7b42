"""Run chosen kernels once each, between CUDA profiler start/stop, for Nsight Compute.

Each case is compiled and run once first (warm-up, outside the profiled range), then run once inside
it, so ``ncu --profile-from-start off`` sees exactly one call of every kernel the op launches
(the Pallas kernel and the small XLA kernels around it):

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --csv --page details \\
        python3 scripts/profile_kernels.py decode_b1 decode_b32 moe_qwen_1 > profile.csv
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _decode(batch, context, **options):
    from gpu_check import _decode_benchmark_case

    from jaxinfer.kernels.attention.decode_pallas import paged_decode_attention

    inputs, _ = _decode_benchmark_case(batch, context)
    return functools.partial(paged_decode_attention, scale=128**-0.5, **options), inputs


def _jax_decode(batch, context):
    from gpu_check import _decode_benchmark_case
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    inputs, _ = _decode_benchmark_case(batch, context)
    return paged_attention, inputs


def _prefill(batch, seq_len, heads, page_size=16, triton=False):
    """The GPU default (the Mosaic GPU kernel on Hopper), or the Triton kernel."""
    from gpu_check import packed_sequences

    from jaxinfer.kernels import attention
    from jaxinfer.kernels.attention import prefill_pallas

    q, k, v, md = packed_sequences(batch, seq_len, heads, heads, 128, page_size, jnp.bfloat16)
    op = prefill_pallas.ragged_paged_attention if triton else attention.ragged_paged_attention
    return functools.partial(op, scale=128**-0.5), (q, k, v, md)


def _cudnn(batch, seq_len, heads):
    q = jax.random.normal(jax.random.PRNGKey(1), (batch, seq_len, heads, 128), jnp.bfloat16)
    return functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn"), (q, q, q)


def _mha(batch, seq_len, heads):
    from jax.experimental.pallas.ops.gpu.attention import mha

    q = jax.random.normal(jax.random.PRNGKey(1), (batch, seq_len, heads, 128), jnp.bfloat16)
    return functools.partial(mha, segment_ids=None, causal=True), (q, q, q)


def _moe(shape, tokens):
    from moe_check import SHAPES, make

    from jaxinfer.kernels.moe import grouped_pallas

    x, ids, weights, params = make(SHAPES[shape], tokens)
    act = SHAPES[shape]["activation"]
    return (lambda x, ids, w, p: grouped_pallas.moe_mlp(x, ids, w, **p, activation=act, distinct_experts=True)), (x, ids, weights, params)


CASES = {
    "decode_b1": lambda: _decode(1, 4096),
    "decode_b32": lambda: _decode(32, 4096),
    "decode_b128": lambda: _decode(128, 2048),
    "jax_decode_b1": lambda: _jax_decode(1, 4096),
    "jax_decode_b32": lambda: _jax_decode(32, 4096),
    "prefill_8192": lambda: _prefill(1, 8192, 32),
    "prefill_triton_8192": lambda: _prefill(1, 8192, 32, triton=True),
    "cudnn_8192": lambda: _cudnn(1, 8192, 32),
    "mha_8192": lambda: _mha(1, 8192, 32),
    "moe_qwen_1": lambda: _moe("qwen3-30b-a3b", 1),
    "moe_qwen_8": lambda: _moe("qwen3-30b-a3b", 8),
    "moe_qwen_4096": lambda: _moe("qwen3-30b-a3b", 4096),
    "moe_gpt_oss_1": lambda: _moe("gpt-oss-20b", 1),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="+", choices=sorted(CASES))
    args = parser.parse_args()
    cuda = ctypes.CDLL("libcuda.so.1")  # the driver's profiler range: cuProfilerStart / cuProfilerStop
    for name in args.cases:
        fn, inputs = CASES[name]()
        run = jax.jit(fn)
        jax.block_until_ready(run(*inputs))
        cuda.cuProfilerStart()
        jax.block_until_ready(run(*inputs))
        cuda.cuProfilerStop()
        print("profiled", name, flush=True)


if __name__ == "__main__":
    main()
