"""GPU check of the Mosaic GPU prefill kernel: parity against the reference, then causal prefill
TFLOP/s next to the Triton kernel (the default) and cuDNN, all in the same run.

    timeout 300 env PYTHONPATH=. python3 scripts/prefill_mgpu_check.py   # writes prefill_mgpu_check.json

Each case runs on its own, its error recorded, so one failing shape does not hide the others. A
barrier mistake in a warp-specialised kernel hangs rather than fails: keep the ``timeout``, or run
the cases one process each (``--cases 0``, ``--cases 1``, ... then ``--cases`` alone for the
benchmark only), so a hang costs one case.
"""

from __future__ import annotations

import argparse
import functools
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import device_time, environment, kernel_breakdown, matmul_rate, write_json  # noqa: E402
from gpu_check import packed_sequences  # noqa: E402

from jaxinfer.kernels.attention import prefill_mgpu, prefill_pallas, reference  # noqa: E402

# (sequences, tokens each, heads, kv heads, head_dim, page_size, new tokens per sequence or None for all,
#  padding tokens after them)
PARITY_CASES = (
    (1, 256, 4, 4, 128, 16, None, 0),     # one sequence, whole key blocks
    (2, 700 // 16 * 16, 8, 2, 128, 16, None, 0),  # GQA, a ragged last query block
    (3, 320, 4, 1, 64, 32, None, 37),     # MQA, head_dim 64, padding tokens
    (2, 512, 8, 8, 128, 16, 100, 0),      # chunked prefill: 100 new tokens over a cached prefix
    (2, 384, 4, 4, 128, 256, None, 200),  # pages larger than a key block, more padding than a block
)

# (key/value pipeline stages, query tiles copied to shared memory, persistent programs, registers of a
#  compute / the memory warpgroup)
VARIANTS = ((3, False, False, (232, 40)), (3, False, True, (232, 40)), (3, False, True, (240, 24)),
            (3, False, False, (240, 24)))


def _name(stages, q_in_smem, persistent, registers):
    return (f"mgpu_stages{stages}_q_{'smem' if q_in_smem else 'registers'}{'_persistent' if persistent else ''}"
            f"_regs{registers[0]}")


def _kernel(stages, q_in_smem, persistent, registers, scale):
    return functools.partial(prefill_mgpu.ragged_paged_attention, scale=scale, stages=stages, q_in_smem=q_in_smem,
                             persistent=persistent, registers=registers)


def parity(cases):
    rows = []
    for case in cases:
        batch, seq_len, heads, kv_heads, head_dim, page_size, new, pad = PARITY_CASES[case]
        seq_len = seq_len // page_size * page_size
        q, k, v, md = packed_sequences(batch, seq_len, heads, kv_heads, head_dim, page_size, jnp.bfloat16)
        if new is not None:
            keep = np.concatenate([np.arange(i * seq_len + seq_len - new, (i + 1) * seq_len) for i in range(batch)])
            md = md.replace(positions=md.positions[keep], slot_mapping=md.slot_mapping[keep],
                            token_seq_ids=md.token_seq_ids[keep])
            q = q[keep]
        if pad:  # padding tokens (slot < 0) after the real ones, as the engine packs a step
            md = md.replace(positions=jnp.pad(md.positions, (0, pad)),
                            slot_mapping=jnp.pad(md.slot_mapping, (0, pad), constant_values=-1),
                            token_seq_ids=jnp.pad(md.token_seq_ids, (0, pad)))
            q = jnp.pad(q, ((0, pad), (0, 0), (0, 0)), constant_values=1)
        row = {"case": case, "batch": batch, "seq_len": seq_len, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
               "page_size": page_size, "new_tokens": new, "padding": pad}
        scale = head_dim**-0.5
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        ref = reference.ragged_paged_attention(f32(q), f32(k), f32(v), md, scale=scale)
        ref = jnp.where((md.slot_mapping >= 0)[:, None, None], ref, 0.0)  # the kernels give padding zeros
        for options in VARIANTS:
            variant = dict(row, variant=_name(*options))
            try:
                got = jax.block_until_ready(_kernel(*options, scale)(q, k, v, md))
            except Exception as e:
                variant.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}",
                               traceback=traceback.format_exc()[-3000:])
            else:
                err = float(jnp.max(jnp.abs(f32(got) - ref)))  # NaN (never < tolerance) fails
                variant.update(max_abs_err=err, ok=bool(err < 2e-2))
            rows.append(variant)
            print({key: value for key, value in variant.items() if key != "traceback"}, flush=True)
    return rows


def benchmarks(flops_rate):
    rows = []
    for batch, seq_len, heads in ((2, 2048, 16), (1, 8192, 32)):
        flops = 4 * batch * heads * seq_len * seq_len * 128 / 2  # causal: half the square
        q, k, v, md = packed_sequences(batch, seq_len, heads, heads, 128, 16, jnp.bfloat16)
        row = {"batch": batch, "seq_len": seq_len, "heads": heads, "matmul_peak_tflops": flops_rate / 1e12}
        for options in VARIANTS:
            name = _name(*options)
            try:
                seconds = device_time(_kernel(*options, 128**-0.5), q, k, v, md, iters=10)
                row[f"{name}_tflops"] = flops / seconds / 1e12
                kernels = kernel_breakdown(_kernel(*options, 128**-0.5), q, k, v, md)
                row[f"{name}_kernel_only_tflops"] = flops / (kernels["entry_mosaic_gpu_kernel"] * 1e-6) / 1e12
            except Exception as e:
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        triton = device_time(functools.partial(prefill_pallas.ragged_paged_attention, scale=128**-0.5), q, k, v, md,
                             iters=10)
        dense_q = jax.random.normal(jax.random.PRNGKey(1), (batch, seq_len, heads, 128), jnp.bfloat16)
        cudnn = device_time(functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn"),
                            dense_q, dense_q, dense_q, iters=10)
        row.update(triton_tflops=flops / triton / 1e12, cudnn_tflops=flops / cudnn / 1e12)
        cudnn_kernels = kernel_breakdown(functools.partial(
            jax.nn.dot_product_attention, is_causal=True, implementation="cudnn"), dense_q, dense_q, dense_q)
        row["cudnn_kernel_only_tflops"] = flops / (max(cudnn_kernels.values()) * 1e-6) / 1e12
        rows.append(row)
        print(row, flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, nargs="*", default=None,
                        help="parity cases to run (indices into PARITY_CASES); given, the benchmark runs only "
                             "when no case is named")
    args = parser.parse_args()
    cases = range(len(PARITY_CASES)) if args.cases is None else args.cases
    name = "prefill_mgpu_check.json" if args.cases is None else f"prefill_mgpu_check_{'_'.join(map(str, cases)) or 'bench'}.json"
    result = {"environment": environment()}
    result["parity"] = parity(cases)
    write_json(name, result)
    if not (args.cases and len(args.cases)):
        result["bf16_matmul_TFLOPs"] = matmul_rate() / 1e12
        result["benchmarks"] = benchmarks(result["bf16_matmul_TFLOPs"] * 1e12)
    print("wrote", write_json(name, result))


if __name__ == "__main__":
    main()
