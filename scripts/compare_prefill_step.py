"""The whole prefill step of another git revision next to the working tree's, in one run: time and
kernels.

Each tree (the revision's, exported with ``git archive``, and the working tree) builds the engine
of ``bench_decode``'s model shape in a process of its own, compiles the mixed step of each prefill
shape, times it (median wall time of ``--repeats`` calls, as ``bench_decode`` does, and apart the
host's share of it: building the step's inputs) and traces ``--trace-calls`` more under the
profiler, whose GPU timeline is summed by kernel (name and HLO op). The trees take turns,
``--rounds`` times, the baseline first in the first, third, ... round and second in the others, so
a drift of the machine, or a cost of going first or second, shows within each tree's rows. A change
that moved a whole-step figure is found by the kernels whose time moved.

    PYTHONPATH=. python3 scripts/compare_prefill_step.py --baseline 829657a   # writes prefill_step_ab.json

Where the repository's history is not at hand, export the revision first (``git archive 829657a |
tar -x -C DIR``) and pass ``--baseline-tree DIR``.

The child uses only what both trees have: ``bench_decode.build_engine`` with its first keywords,
``Request``, ``CompileKey``, ``runner.mixed_inputs`` and ``runner.run_mixed``, so attention-only
models (``llama3-8b``, ``qwen3-30b-a3b``) of revisions back to the bucketed engine work. Off a GPU
(a smoke run) the kernel summary is left out.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(SCRIPTS)


def export_revision(revision: str, into: str) -> str:
    """The tree of ``revision`` written under ``into`` (``git archive``); returns its path."""
    tree = os.path.join(into, revision.replace("/", "_"))
    os.makedirs(tree)
    archive = subprocess.run(["git", "-C", REPO, "archive", revision], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    return tree


def child(args) -> dict:
    """Runs inside one tree (its ``jaxinfer`` and ``scripts`` first on the path)."""
    sys.path[:0] = [args.tree, os.path.join(args.tree, "scripts")]
    import jax
    import numpy as np
    from bench_decode import build_engine
    from benchlib import gpu_kernels

    from jaxinfer.engine.aot import MIXED, CompileKey
    from jaxinfer.engine.config import bucket_for
    from jaxinfer.engine.request import Request
    from jaxinfer.engine.sampling import SamplingParams

    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.prefill]
    max_len = max(length for _, length in shapes) + 16
    max_seqs = max(batch for batch, _ in shapes)
    config, _, engine = build_engine(args.model, args.layers, steps=1, max_len=max_len, max_seqs=max_seqs,
                                     batched_tokens=max(batch * length for batch, length in shapes),
                                     num_pages=args.num_pages)
    on_gpu = jax.devices()[0].platform == "gpu"
    greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rows = []
    for batch, length in shapes:
        requests = []
        for i in range(batch):
            r = Request(i, list(np.random.RandomState(i).randint(0, config.vocab_size, length)), greedy, seed=i,
                        stop_ids=(), max_output_tokens=1)
            r.pages = engine.scheduler.allocator.allocate(-(-length // engine.layout.page_size))
            requests.append(r)
        items = [(r, length) for r in requests]
        key = CompileKey(MIXED, bucket_for(batch * length, engine.grid.token_buckets), engine.config.max_num_seqs,
                         engine.config.max_pages_per_seq)
        start = time.perf_counter()
        engine.runner.compile(key)
        compile_s = time.perf_counter() - start
        engine.runner.run_mixed(key, items)
        times = []  # bench_decode's timing, written out: older trees' bench_decode has no helper for it
        for _ in range(args.repeats):
            start = time.perf_counter()
            engine.runner.run_mixed(key, items)
            times.append(time.perf_counter() - start)
        host = []  # the step's inputs built on the host, part of the wall time above
        for _ in range(args.repeats):
            start = time.perf_counter()
            engine.runner.mixed_inputs(key, items)
            host.append(time.perf_counter() - start)
        row = {"batch": batch, "prompt": length, "seconds": float(np.median(times)), "compile_s": compile_s,
               "host_inputs_s": float(np.median(host))}
        if on_gpu:
            with tempfile.TemporaryDirectory() as trace_dir:
                with jax.profiler.trace(trace_dir):
                    for _ in range(args.trace_calls):
                        engine.runner.run_mixed(key, items)
                kernels = gpu_kernels(trace_dir)
            totals = collections.defaultdict(float)
            for k_start, k_end, name in kernels:
                totals[name] += (k_end - k_start) * 1e-3 / args.trace_calls
            row["kernels_us"] = dict(sorted(totals.items(), key=lambda kv: -kv[1]))
            row["kernel_us_total"] = sum(totals.values())
        rows.append(row)
        for r in requests:
            engine.scheduler.allocator.free(r.pages)
    return {"rows": rows}


def run_child(tree: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--tree", tree, "--model", args.model,
           "--layers", str(args.layers), "--repeats", str(args.repeats), "--trace-calls", str(args.trace_calls),
           "--prefill", *args.prefill]
    if args.num_pages is not None:
        cmd += ["--num-pages", str(args.num_pages)]
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the child in {tree} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def kernel_deltas(before: dict, after: dict, top: int = 15) -> list[dict]:
    """The kernels whose time per step moved most, after minus before (us)."""
    names = set(before) | set(after)
    moved = sorted(names, key=lambda n: -abs(after.get(n, 0.0) - before.get(n, 0.0)))[:top]
    return [{"kernel": n, "before_us": before.get(n, 0.0), "after_us": after.get(n, 0.0),
             "delta_us": after.get(n, 0.0) - before.get(n, 0.0)} for n in moved]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="HEAD", help="git revision to compare the working tree against")
    parser.add_argument("--baseline-tree", help="the baseline revision's files, already exported (then --baseline "
                                                 "only names it)")
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prefill", nargs="+", default=["1x8192", "16x1024"], help="prefill shapes, BATCHxLENGTH")
    parser.add_argument("--num-pages", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--trace-calls", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    sys.path.insert(0, SCRIPTS)
    from benchlib import environment, write_json

    result = {"environment": environment(), "baseline": args.baseline, "model": args.model, "layers": args.layers,
              "rounds": []}
    with tempfile.TemporaryDirectory() as scratch:
        before = os.path.abspath(args.baseline_tree) if args.baseline_tree else export_revision(args.baseline, scratch)
        trees = {"before": before, "after": REPO}
        for round_index in range(args.rounds):
            order = ["before", "after"] if round_index % 2 == 0 else ["after", "before"]
            runs = {name: run_child(trees[name], args) for name in order}
            shapes = []
            for before, after in zip(runs["before"]["rows"], runs["after"]["rows"]):
                row = {"batch": after["batch"], "prompt": after["prompt"], "before_s": before["seconds"],
                       "after_s": after["seconds"], "after_over_before": after["seconds"] / before["seconds"],
                       "compile_s": [before["compile_s"], after["compile_s"]],
                       "host_inputs_s": [before["host_inputs_s"], after["host_inputs_s"]]}
                if "kernels_us" in after:
                    row["kernel_us_total"] = [before["kernel_us_total"], after["kernel_us_total"]]
                    row["moved"] = kernel_deltas(before["kernels_us"], after["kernels_us"])
                shapes.append(row)
                print({k: v for k, v in row.items() if k != "moved"}, flush=True)
                for moved in row.get("moved", [])[:5]:
                    print("   ", moved, flush=True)
            result["rounds"].append({"first": order[0], "shapes": shapes, "runs": runs})
            write_json("prefill_step_ab.json", result)


if __name__ == "__main__":
    main()
