"""Where one whole-model decode call spends its GPU time: a profiler trace, summarised per kernel.

Builds a model of ``bench_decode``'s shapes (random bf16 weights; fewer layers keep it quick),
runs the engine's decode loop once under ``jax.profiler.trace`` and reads the GPU timeline back:
the call's span, the time some kernel was running (busy), the gaps between kernels, and the kernels
by total time with their HLO op names (``--hlo`` writes the optimised HLO to map fusion names to
ops). Tracing slows the host side and so inflates the gaps; compare busy time and kernel counts.
A kernel launched early (``jaxinfer.kernels.pdl``) counts its wait at entry, while the kernel in
front of it runs, in its traced duration: per-kernel times of the decode step are upper bounds.

    PYTHONPATH=. python3 scripts/profile_step.py --model qwen3-30b-a3b --layers 4 --batch 1

``--timeline`` prints one step's kernels in order, with the gaps between them (also in the JSON).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import MODELS, build_engine, decode_requests  # noqa: E402
from benchlib import (KERNEL_FAMILIES, busy_ns, environment, force_reference, gpu_kernels, write_json,  # noqa: E402
                      write_text)


def summarise(kernels, steps: int, layers: int, top: int = 40) -> dict:
    start, end = kernels[0][0], max(k[1] for k in kernels)
    busy = busy_ns(kernels)
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for k_start, k_end, name in kernels:
        by_name[name][0] += 1
        by_name[name][1] += k_end - k_start
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    per_step = 1e-3 / steps
    return {
        "span_us_per_step": (end - start) * per_step,
        "busy_us_per_step": busy * per_step,
        "idle_us_per_step": (end - start - busy) * per_step,
        "kernels_per_step": len(kernels) / steps,
        "kernels_per_layer_step": len(kernels) / steps / layers,
        "top": [{"kernel": name, "calls_per_step": n / steps, "us_per_step": total * per_step,
                 "us_per_call": total / n * 1e-3} for name, (n, total) in ranked[:top]],
    }


def one_step(kernels, steps: int) -> list[dict]:
    """The kernels of one decode step in the middle of the call, in launch order: start and end
    relative to the step's first kernel and the gap since the previous kernel ended (negative where
    a kernel launched early overlaps the one before). A step is cut at the LM head (the longest
    kernel run once per step)."""
    counts = collections.Counter(name for _, _, name in kernels)
    totals = collections.defaultdict(float)
    for start, end, name in kernels:
        totals[name] += end - start
    once = [name for name, n in counts.items() if n == steps]
    if not once:
        return []
    head = max(once, key=totals.__getitem__)
    marks = [i for i, (_, _, name) in enumerate(kernels) if name == head]
    first, last = marks[steps // 2 - 1] + 1, marks[steps // 2] + 1  # after one LM head, through the next
    origin, previous_end, rows = kernels[first][0], kernels[first][0], []
    for start, end, name in kernels[first:last]:
        rows.append({"start_us": (start - origin) * 1e-3, "us": (end - start) * 1e-3,
                     "gap_us": (start - previous_end) * 1e-3, "kernel": name})
        previous_end = max(previous_end, end)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hlo", action="store_true", help="also write each decode executable's optimised HLO")
    parser.add_argument("--timeline", action="store_true", help="also print one step's kernels in order")
    parser.add_argument("--reference", nargs="*", default=[], choices=KERNEL_FAMILIES,
                        help="op families to run as their jnp references instead of the GPU kernels")
    args = parser.parse_args()
    force_reference(args.reference)
    suffix = "".join(f"_ref-{family}" for family in args.reference)
    _, _, engine = build_engine(args.model, args.layers, steps=args.steps, max_len=args.context + args.steps + 16,
                                max_seqs=max(args.batch), batched_tokens=max(args.batch))
    result = {"environment": environment(), "model": args.model, "layers": args.layers, "context": args.context,
              "steps_per_call": args.steps, "reference_ops": args.reference, "batches": {}}
    for batch in args.batch:
        requests, key = decode_requests(engine, batch, args.context, args.steps)
        if args.hlo:  # to map the profile's fusion names to the ops they hold
            write_text(f"profile_step_{args.model}_b{batch}.hlo.txt", engine.runner.executable(key).as_text())
        engine.runner.run_decode(key, requests)  # warm
        with tempfile.TemporaryDirectory() as trace_dir:
            with jax.profiler.trace(trace_dir):
                engine.runner.run_decode(key, requests)
            kernels = gpu_kernels(trace_dir)
            summary = summarise(kernels, args.steps, args.layers)
            summary["one_step"] = one_step(kernels, args.steps)
        result["batches"][batch] = summary
        print(f"batch {batch}: span {summary['span_us_per_step']:.0f} us/step, busy {summary['busy_us_per_step']:.0f}, "
              f"{summary['kernels_per_layer_step']:.1f} kernels per layer-step", flush=True)
        for row in summary["top"]:
            print(f"  {row['us_per_step']:8.1f} us  {row['calls_per_step']:6.1f}x  {row['kernel']}")
        if args.timeline:
            print("  one step: start, duration, gap since the kernel before (us)")
            for row in summary["one_step"]:
                print(f"  {row['start_us']:8.2f} {row['us']:7.2f} {row['gap_us']:6.2f}  {row['kernel']}")
        for r in requests:
            engine.scheduler.allocator.free(r.pages)
    print("wrote", write_json(f"profile_step_{args.model}{suffix}.json", result))


if __name__ == "__main__":
    main()
