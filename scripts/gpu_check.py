"""GPU proof for the attention kernels: parity against the references at realistic shapes, and
benchmarks next to jax's own Pallas ops, cuDNN and the ceilings measured in the same run.

    PYTHONPATH=. python3 scripts/gpu_check.py            # writes gpu_check.json to $OUT (or .)
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import copy_bandwidth, device_time, environment, matmul_rate, write_json  # noqa: E402

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
    ]
    options = {"plain": {}, "window": {"sliding_window": 300}, "softcap": {"logit_softcap": 30.0}, "sinks": "sinks"}
    for case in cases:
        for dtype in (jnp.bfloat16, jnp.float32):
            q, k, v, tables, lengths = _paged_case(dtype=dtype, **case)
            for name, extra in options.items():
                if extra == "sinks":
                    extra = {"sinks": jax.random.normal(jax.random.PRNGKey(9), (case["heads"],), jnp.float32)}
                scale = case["head_dim"] ** -0.5
                ref = reference.paged_decode_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                                       v.astype(jnp.float32), tables, lengths, scale=scale, **extra)
                out = paged_decode_attention(q, k, v, tables, lengths, scale=scale, **extra)
                err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
                tol = 2e-2 if dtype == jnp.bfloat16 else 2e-3
                results.append({**case, "dtype": jnp.dtype(dtype).name, "options": name, "max_abs_err": err,
                                "ok": bool(err < tol)})
    return results


def decode_benchmarks(bandwidth):
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as jax_paged_attention

    rows = []
    for batch, context in ((1, 4096), (32, 4096), (128, 2048)):
        q, k, v, tables, lengths = _paged_case(batch, 32, 8, 128, 16, context, jnp.bfloat16, ragged=False)
        kv_bytes = 2 * batch * context * 8 * 128 * 2
        ours = device_time(functools.partial(paged_decode_attention, scale=128**-0.5), q, k, v, tables, lengths)
        theirs = device_time(jax_paged_attention, q, k, v, tables, lengths)
        rows.append({
            "batch": batch, "context": context, "bytes": kv_bytes,
            "ours_us": ours * 1e6, "ours_bw_fraction": kv_bytes / ours / bandwidth,
            "jax_paged_attention_us": theirs * 1e6, "jax_bw_fraction": kv_bytes / theirs / bandwidth,
        })
        print(rows[-1], flush=True)
    return rows


def prefill_checks(flops_rate):
    """Ragged prefill kernel: parity, then causal benchmarks next to cuDNN and jax's Pallas mha."""
    if importlib.util.find_spec("jaxinfer.kernels.attention.prefill_pallas") is None:
        return {"skipped": "no prefill kernel"}
    from jax.experimental.pallas.ops.gpu.attention import mha as jax_mha

    from jaxinfer.cache.metadata import AttentionMetadata
    from jaxinfer.kernels.attention.prefill_pallas import ragged_paged_attention

    def single_sequence(seq_len, heads, kv_heads, head_dim, page_size, dtype, seed=0):
        key = jax.random.PRNGKey(seed)
        k1, k2, k3 = jax.random.split(key, 3)
        pages = seq_len // page_size
        perm = np.random.RandomState(seed).permutation(pages)
        k = jax.random.normal(k1, (kv_heads, pages, page_size, head_dim), dtype)
        v = jax.random.normal(k2, (kv_heads, pages, page_size, head_dim), dtype)
        q = jax.random.normal(k3, (seq_len, heads, head_dim), dtype)
        positions = jnp.arange(seq_len, dtype=jnp.int32)
        md = AttentionMetadata(positions=positions, slot_mapping=positions, token_seq_ids=jnp.zeros_like(positions),
                               block_tables=jnp.asarray(perm, jnp.int32)[None], seq_lens=jnp.array([seq_len], jnp.int32),
                               logits_indices=jnp.array([seq_len - 1], jnp.int32))
        return q, k, v, md

    out = {"parity": [], "benchmarks": []}
    for heads, kv_heads, head_dim, seq_len, extra in ((32, 8, 128, 2048, {}), (16, 16, 64, 1024, {"sliding_window": 200}),
                                                      (8, 2, 256, 1024, {"logit_softcap": 20.0})):
        q, k, v, md = single_sequence(seq_len, heads, kv_heads, head_dim, 16, jnp.bfloat16)
        scale = head_dim**-0.5
        ref = reference.ragged_paged_attention(q[:512], k, v, md.replace(positions=md.positions[:512],
                                               token_seq_ids=md.token_seq_ids[:512], seq_lens=jnp.array([512], jnp.int32)),
                                               scale=scale, **extra)
        got = ragged_paged_attention(q[:512], k, v, md.replace(positions=md.positions[:512],
                                     token_seq_ids=md.token_seq_ids[:512], seq_lens=jnp.array([512], jnp.int32)),
                                     scale=scale, **extra)
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32))))
        out["parity"].append({"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "tokens": 512,
                              "options": list(extra), "max_abs_err": err, "ok": bool(err < 2e-2)})
    for batch, seq_len in ((2, 2048), (1, 8192)):
        heads = 16 if seq_len == 2048 else 32
        flops = 4 * batch * heads * seq_len * seq_len * 128 / 2  # causal: half the square
        q, k, v, md = single_sequence(seq_len, heads, heads, 128, 16, jnp.bfloat16)
        ours = device_time(functools.partial(ragged_paged_attention, scale=128**-0.5), q, k, v, md) * batch
        dense_q = jax.random.normal(jax.random.PRNGKey(1), (batch, seq_len, heads, 128), jnp.bfloat16)
        cudnn = device_time(functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn"),
                            dense_q, dense_q, dense_q)
        pallas_mha = device_time(functools.partial(jax_mha, segment_ids=None, causal=True), dense_q, dense_q, dense_q)
        row = {"batch": batch, "seq_len": seq_len, "heads": heads, "ours_tflops": flops / ours / 1e12,
               "cudnn_tflops": flops / cudnn / 1e12, "jax_pallas_mha_tflops": flops / pallas_mha / 1e12,
               "matmul_peak_tflops": flops_rate / 1e12}
        out["benchmarks"].append(row)
        print(row, flush=True)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--skip-prefill", action="store_true")
    args = parser.parse_args()
    result = {"environment": environment()}
    result["copy_bandwidth_TBps"] = copy_bandwidth() / 1e12
    result["bf16_matmul_TFLOPs"] = matmul_rate() / 1e12
    print(result, flush=True)
    result["decode_parity"] = decode_parity()
    print("decode parity ok:", all(r["ok"] for r in result["decode_parity"]), flush=True)
    result["decode_benchmarks"] = decode_benchmarks(result["copy_bandwidth_TBps"] * 1e12)
    if not args.skip_prefill:
        result["prefill"] = prefill_checks(result["bf16_matmul_TFLOPs"] * 1e12)
    print("wrote", write_json("gpu_check.json", result))


if __name__ == "__main__":
    main()
