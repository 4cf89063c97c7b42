"""GPU proof for the linear-attention kernels (gated delta rule, KDA, lightning attention): parity of
the default implementation against the token-by-token reference over packed varlen sequences, and
kernel times next to the chunked jnp form, flash-linear-attention (where ``fla`` imports) and the
copy bandwidth, all measured in the same run.

    PYTHONPATH=. python3 scripts/linear_attention_check.py            # writes linear_attention_check.json
    PYTHONPATH=. python3 scripts/linear_attention_check.py --parity-only
    PYTHONPATH=. python3 scripts/linear_attention_check.py --interpret --parity-only   # on a CPU: the script itself

Prefill shapes: Qwen3-Next's gated DeltaNet (32 value heads, d 128), Kimi Linear's KDA (32 heads, d
128), MiniMax-Text-01's lightning attention (64 heads, d 128), bf16 inputs, float32 states; one
sequence of T = 1024 ... 16384 and a varlen step of 8 sequences. Our ops take as many key as value
heads (the gated DeltaNet mixer repeats Qwen3-Next's 16 key heads to its 32 value heads); fla runs the
same inputs, and for the gated delta rule also its grouped-value form with 16 key heads. Decode: B =
1, 64, 256 rows over a pool of 512 slots; the state traffic (read + write of each row's float32 state)
over the kernel time; fla's recurrent kernels on a [B, H, K, V] state batch beside it.

Where torch and JAX share the GPU, cap JAX's share: ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.5``.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import copy_bandwidth, donated_kernel_time, environment, kernel_time, write_json  # noqa: E402

from jaxinfer.kernels import gated_delta, kda, lightning, registry  # noqa: E402

OPS = {  # name: (prefill op, decode op, heads, head dim, gate per key channel)
    "gated_delta": (gated_delta.gated_delta_rule_op, gated_delta.recurrent_update_op, 32, 128, False),
    "kda": (kda.kda_op, kda.recurrent_update_op, 32, 128, True),
    "lightning": (lightning.lightning_attention_op, lightning.recurrent_update_op, 64, 128, None),
}


def _unit(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def prefill_inputs(name, lengths, heads, dim, dtype, seed=0):
    """(q, k, v, gate..., cu_seqlens, initial_state) of one packed step."""
    t = sum(lengths)
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = (_unit(jax.random.normal(keys[0], (t, heads, dim))) * dim ** -0.5).astype(dtype)
    k = _unit(jax.random.normal(keys[1], (t, heads, dim))).astype(dtype)
    v = jax.random.normal(keys[2], (t, heads, dim)).astype(dtype)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    state = 0.1 * jax.random.normal(keys[3], (len(lengths), heads, dim, dim), jnp.float32)
    if name == "lightning":
        slope = jnp.asarray(0.5 ** (8 / heads * (np.arange(heads) + 1)), jnp.float32)
        return q, k, v, slope, cu, state
    gate_shape = (t, heads, dim) if OPS[name][4] else (t, heads)
    g = -jnp.abs(jax.random.normal(keys[4], gate_shape)) * 0.1
    beta = jax.nn.sigmoid(jax.random.normal(keys[5], (t, heads)))
    return q, k, v, g, beta, cu, state


def decode_inputs(name, rows, pool_slots, heads, dim, dtype, seed=1):
    """(pool, slots, q, k, v, gate...) of one decode step; every other row a distinct slot."""
    pool = jax.random.normal(jax.random.PRNGKey(seed), (pool_slots, heads, dim, dim), jnp.float32) * 0.1
    slots = jnp.asarray(np.random.RandomState(seed).permutation(pool_slots)[:rows], jnp.int32)
    step = prefill_inputs(name, [rows], heads, dim, dtype, seed)
    return (pool, slots, *step[:-2])


def _close(got, want) -> float:
    """Largest |got - want| relative to max |want|, over the outputs and states."""
    return max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)) / (jnp.max(jnp.abs(w)) + 1e-30))
               for g, w in zip(got, want))


def parity(heads, dim):
    rows = []
    for name, (prefill_op, decode_op, _, _, _) in OPS.items():
        for dtype in (jnp.float32, jnp.bfloat16):
            args = prefill_inputs(name, [300, 1, 0, 130, 64, 517], heads, dim, dtype)
            decode_args = decode_inputs(name, 16, 40, heads, dim, dtype)
            for op, inputs in ((prefill_op, args), (decode_op, decode_args)):
                with registry.recording() as chosen:
                    got = jax.jit(op)(*inputs)
                # The truth in float32 on the inputs as the kernel saw them (bf16 values, exactly widened).
                want = op.reference.fn(*(a.astype(jnp.float32) if a.dtype == dtype else a for a in inputs))
                rows.append({"op": op.name, "dtype": jnp.dtype(dtype).name, "implementation": sorted(chosen[op.name]),
                             "max_rel_error": _close(got, want)})
                print(rows[-1], flush=True)
    return rows


def _torch_timer(run, iters=20):
    """Seconds per call of a torch CUDA callable, by CUDA events around ``iters`` calls after one warm-up."""
    import torch

    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e-3


def _fla(name, kind):
    """flash-linear-attention's chunked (``kind="chunk"``) or recurrent kernel for ``name``; None
    without fla (or for lightning attention, which it does not have in this form)."""
    try:
        if name == "gated_delta":
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
            return chunk_gated_delta_rule if kind == "chunk" else fused_recurrent_gated_delta_rule
        if name == "kda":
            from fla.ops.kda import chunk_kda, fused_recurrent_kda
            return chunk_kda if kind == "chunk" else fused_recurrent_kda
    except ImportError:
        pass
    return None


def _fla_prefill(name, args, key_heads=None):
    """Seconds per call of fla's chunked kernel on the same device buffers (None without fla).
    ``key_heads``: q and k cut to that many heads, fla's grouped-value form (Qwen3-Next's 16 key heads
    for 32 value heads), which our op takes with the key heads repeated."""
    fla_fn = _fla(name, "chunk")
    if fla_fn is None:
        return None
    import torch

    q, k, v, g, beta, cu, state = (torch.from_dlpack(a) for a in args)
    q, k, v, g, beta = (x.unsqueeze(0) for x in (q, k, v, g, beta))
    if key_heads:
        q, k = q[:, :, :key_heads].contiguous(), k[:, :, :key_heads].contiguous()
    cu = cu.long()
    return _torch_timer(lambda: fla_fn(q, k, v, g=g, beta=beta, scale=1.0, initial_state=state,  # q comes scaled
                                       output_final_state=True, cu_seqlens=cu))


def _fla_decode(name, rows, heads, dim):
    """Seconds per call of fla's recurrent kernel on one token for each of ``rows`` sequences, with
    their states in a [rows, H, K, V] batch (fla has no slot pool); None without fla."""
    fla_fn = _fla(name, "recurrent")
    if fla_fn is None:
        return None
    import torch

    q, k, v, g, beta, _, _ = (torch.from_dlpack(a) for a in prefill_inputs(name, [rows], heads, dim, jnp.bfloat16))
    q, k, v, g, beta = (x.unsqueeze(1) for x in (q, k, v, g, beta))  # [rows, 1, ...]
    state = torch.zeros(rows, heads, dim, dim, dtype=torch.float32, device=q.device)
    return _torch_timer(lambda: fla_fn(q, k, v, g=g, beta=beta, scale=1.0, initial_state=state,
                                       output_final_state=True))


def benchmarks(bandwidth, ops, save, steps, decode_only=False):
    """Prefill ``steps`` (each a list of sequence lengths) and decode at B = 1, 64, 256 of ``ops``;
    ``save(rows)`` after each row."""
    rows = []
    for name in ops:
        prefill_op, decode_op, heads, dim, _ = OPS[name]
        for lengths in () if decode_only else steps:
            args = prefill_inputs(name, lengths, heads, dim, jnp.bfloat16)
            # A function of its own per timing: a traced program keeps the implementation it chose.
            with registry.recording() as chosen:
                row = {"op": prefill_op.name, "lengths": lengths, "heads": heads, "dim": dim,
                       "kernel_ms": kernel_time(lambda *a: prefill_op(*a), *args) * 1e3}
            row["implementation"] = sorted(chosen[prefill_op.name])
            with registry.force(prefill_op.name, "chunked"):
                row["chunked_jnp_ms"] = kernel_time(lambda *a: prefill_op(*a), *args) * 1e3
            fla = _fla_prefill(name, args)
            if fla is not None:
                row["fla_ms"] = fla * 1e3
                row["x_fla"] = row["kernel_ms"] / row["fla_ms"]
                if name == "gated_delta":
                    row["fla_16_key_heads_ms"] = _fla_prefill(name, args, key_heads=heads // 2) * 1e3
            rows.append(row)
            print(row, flush=True)
            save(rows)
        for batch in (1, 64, 256):
            args = decode_inputs(name, batch, 512, heads, dim, jnp.bfloat16)
            # The pool updated in place (donated), as the engine's decode step does.
            seconds = donated_kernel_time(lambda pool, *rest: decode_op(pool, *rest)[1], *args)
            traffic = 2 * batch * heads * dim * dim * 4
            rows.append({"op": decode_op.name, "batch": batch, "heads": heads, "dim": dim, "kernel_us": seconds * 1e6,
                         "state_TBps": traffic / seconds / 1e12, "of_copy_bandwidth": traffic / seconds / bandwidth})
            fla = _fla_decode(name, batch, heads, dim)
            if fla is not None:
                rows[-1].update(fla_us=fla * 1e6, fla_state_TBps=traffic / fla / 1e12)
            print(rows[-1], flush=True)
            save(rows)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parity-only", action="store_true")
    parser.add_argument("--interpret", action="store_true", help="the Pallas kernels in interpret mode, small heads")
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--decode-only", action="store_true", help="benchmark the decode steps alone")
    parser.add_argument("--ops", nargs="+", choices=sorted(OPS), default=list(OPS), help="benchmark these ops")
    parser.add_argument("--steps", nargs="+", default=["1024", "4096", "8192", "16384", "8x512"],
                        help="prefill steps: N (one sequence of N tokens) or BxN (B sequences of N)")
    parser.add_argument("--out", default="linear_attention_check.json", help="the JSON file's name")
    args = parser.parse_args()
    result = {"environment": environment()}
    if args.skip_parity:
        pass
    elif args.interpret:
        with registry.targeting(registry.Target.interpreted()):
            result["parity"] = parity(heads=2, dim=32)
    else:
        result["parity"] = parity(heads=4, dim=128)
    write_json(args.out, result)
    if not args.parity_only:
        bandwidth = copy_bandwidth()
        result["copy_bandwidth_TBps"] = bandwidth / 1e12

        def save(rows):
            result["benchmarks"] = rows
            write_json(args.out, result)

        steps = [[int(n)] * int(b) for b, n in (step.split("x") if "x" in step else ("1", step) for step in args.steps)]
        benchmarks(bandwidth, args.ops, save, steps, args.decode_only)
    print(write_json(args.out, result))


if __name__ == "__main__":
    main()
