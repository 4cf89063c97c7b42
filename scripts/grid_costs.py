"""What each bucket of the compile grid costs: compile seconds per key, and the device time of its
program at the shapes it pads to (the fastest of ``--repeats`` calls). The evidence for the default bucket axes (``BucketGrid``).

    PYTHONPATH=. python3 scripts/grid_costs.py [--model DIR] [--seqs 1 8] [--json OUT]

For each decode key (sequence bucket x page bucket) it compiles the decode loop afresh (no
persistent cache) and times one call with every row active at the longest length the key holds, per
decode step; for each mixed key (token bucket) the same for a step of that many prompt tokens.
Defaults: the CLI's tiny checkpoint with the CLI's default engine options.
"""

from __future__ import annotations

import argparse
import json
import time

import jax

from jaxinfer.engine.aot import DECODE, MIXED, CompileKey
from jaxinfer.engine.request import Request
from jaxinfer.engine.sampling import SamplingParams


def _requests(num: int, length: int, page_size: int, max_output: int, steps: int) -> list[Request]:
    """``num`` requests of ``length`` cached tokens each, with pages for ``steps`` more, on disjoint
    pages (the cache holds zeros: the values do not change the time)."""
    out = []
    pages_each = -(-(length + steps) // page_size)
    for i in range(num):
        r = Request(i, [3] * length, SamplingParams(temperature=0, max_tokens=max_output, ignore_eos=True), i, (),
                    max_output)
        r.output_token_ids = [5]
        r.num_computed = length
        r.pages = list(range(i * pages_each, (i + 1) * pages_each))
        out.append(r)
    return out


def _time(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls after a first one: the least disturbed by other work on a
    shared host."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    from jaxinfer import LLM
    from jaxinfer.tiny import ensure_default_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--seqs", type=int, nargs="*", default=None, help="sequence buckets to measure (default all)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--skip-mixed", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    options = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   warmup=False, compilation_cache=False, show_progress=False)
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    llm = LLM(args.model or ensure_default_checkpoint(), **options)
    engine, runner = llm.engine, llm.engine.runner
    config, page_size, steps = engine.config, engine.config.page_size, engine.config.decode_steps
    rows = []
    seq_buckets = [s for s in engine.grid.seq_buckets if args.seqs is None or s in args.seqs]
    for s in seq_buckets:
        for p in range(1, config.max_pages_per_seq + 1):
            if p not in engine.grid.page_buckets and p & (p - 1):
                continue  # powers of two and the grid's buckets
            key = CompileKey(DECODE, s, s, p)
            start = time.perf_counter()
            lowered = runner.lower(key)
            lowered_at = time.perf_counter()
            runner.add_executable(key, runner.compile_lowered(lowered))
            compiled_at = time.perf_counter()
            length = max(1, p * page_size - steps)  # the longest that still takes p pages after `steps` tokens
            requests = _requests(s, length, page_size, steps + 1, steps)  # one output token so far: `steps` left
            seconds = _time(lambda: runner.run_decode(key, requests), args.repeats)
            rows.append(dict(kind=DECODE, seqs=s, pages=p, lower_s=round(lowered_at - start, 3),
                             compile_s=round(compiled_at - lowered_at, 3), ms_per_step=round(1e3 * seconds / steps, 3)))
            print(json.dumps(rows[-1]), flush=True)
    if not args.skip_mixed:
        for t in engine.grid.token_buckets:
            key = CompileKey(MIXED, t, config.max_num_seqs, config.max_pages_per_seq)
            start = time.perf_counter()
            lowered = runner.lower(key)
            lowered_at = time.perf_counter()
            runner.add_executable(key, runner.compile_lowered(lowered))
            compiled_at = time.perf_counter()
            n = min(t, config.max_model_len - 1)
            requests = _requests(1, 0, page_size, n, n)
            for r in requests:
                r.prompt_token_ids, r.output_token_ids, r.num_computed = [3] * n, [], 0
            seconds = _time(lambda: runner.run_mixed(key, [(requests[0], n)]), args.repeats)
            rows.append(dict(kind=MIXED, tokens=t, lower_s=round(lowered_at - start, 3),
                             compile_s=round(compiled_at - lowered_at, 3), ms_per_call=round(1e3 * seconds, 3)))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, config=dict(
                max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens, page_size=page_size, decode_steps=steps),
                rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
