"""The engine's decode step against a variant of itself, in one process: both engines share the weights
and their timed calls alternate, so the few percent the GPU drifts between processes does not decide
the comparison.

A variant replaces one GPU op by another implementation while the variant's engine compiles (its
steps trace, and so pick their ops, then). The variants:

- ``unfused-rotary-decode``: the q/k norm + RoPE + cache write as its own kernel before the decode
  attention kernel, instead of inside it.
- ``skinny-router``: the MoE router's projection on the few-row Triton projection kernel instead of
  XLA's (a run of Triton kernels from the norm to the experts).
- ``skinny-one-row``: the same for every one-row projection narrower than 65536 outputs (the router
  and the o projection; not the LM head).
- ``moe-down-four-stages``: the decode-sized MoE down projection in 4 pipeline stages at every
  token count (the default takes 3 from 2 tokens on).
- ``unfused-norm-project``: a block's residual add + RMSNorm as its own kernel before the few-row
  projection kernel, instead of folded into it (``linear.norm_project`` at one row).
- ``decode-blocks-N`` / ``decode-splits-N``: the fused decode attention over N-token KV blocks, or in N
  splits per (sequence, KV head) (``decode_pallas.default_blocking`` picks both otherwise; one split
  writes the output itself, with no merge kernel). ``decode-blocks-32`` (72 programs instead of 36 at
  one sequence of 512 tokens) made the 24-layer step no faster.
- ``decode-kv-first``: the fused decode attention with one block per program issues its K/V reads
  before it rotates q and k (``kv_reads_first``), so that their memory latency overlaps the rotation.
- ``decode-warps-N``: the fused decode attention in N warps per program instead of 4.
- ``norm-project-8x2048``: the one-row norm + projection kernel with 8 weight rows by up to 2048 columns
  per step (a 2048-wide row in one step, no pipeline; wider rows in 3 stages). Against 4 by 1024 this
  made rows up to 2048 wide the default (``skinny_pallas.default_norm_blocking``); it still differs
  from main on wider rows.
- ``graph-loop``: the decode loop's ``while`` and the sampler's ``cond``s recorded into the CUDA graph
  (XLA's ``WHILE`` and ``CONDITIONAL`` command-buffer commands) instead of run by the host, which
  reads each predicate back from the device. XLA records a ``cond`` or a ``while`` only when all of
  its body can be recorded: the filter ``cond`` holds CUB's sort, which cannot, so on its own this
  changes nothing.
- ``xla-sort``: XLA's own sort kernels instead of CUB's radix sort; then the filter ``cond`` is
  recorded into the graph and no longer waits on the host (``graph-loop+xla-sort``: the whole loop
  in one graph).
- ``one-sampler-loop``: every batch through the decode loop with the full sampler, as before the
  all-greedy loop (``ModelRunner._decode_loop``).
- ``greedy-sampler``: every sampler a bare argmax, without its ``cond``s (it ignores temperature and
  the filters; main's all-greedy loop already samples greedy batches this way).
- ``unchecked-logits``: the sampler without its check that each row's logits are finite (main ends a
  request whose logits are NaN / Inf with an error instead of sampling them).
- ``logprobs``: the engine built with ``max_logprobs=5`` (its default) instead of None, no request asking.
- ``trigger-FAMILY=POINT[,FAMILY=POINT...]``: the Pallas kernels of those families let the next kernel
  launch at another point (``jaxinfer.kernels.pdl``: ``start``, or ``none``: as the last program
  exits); ``trigger-all=none`` for every family.
- Variants joined by ``+`` apply together (``graph-loop+greedy-sampler``).

What the sampler and loop variants measured at B=1 (``benchmarks/results/2026-11-30-h200-r9/``),
before the all-greedy loop: the full sampler cost a greedy 48-layer step about 47 us
(``greedy-sampler`` 0.983), a third of it the filter ``cond``'s trip through the host (``xla-sort``
0.996); the loop in the graph gained nothing; ``logprobs`` 1.004. With the all-greedy loop in main,
``one-sampler-loop`` was 1.018.

Several variants given together each run against main in the same process, their calls alternating.

    PYTHONPATH=. python3 scripts/decode_ab.py --variant unfused-rotary-decode   # Qwen3-30B-A3B, B=1
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import MODELS, build_engine, decode_requests  # noqa: E402
from benchlib import environment, write_json  # noqa: E402

from jaxinfer.kernels import pdl  # noqa: E402


def _unfused_rotary_decode(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens, *,
                           q_norm=None, k_norm=None, norm_eps=1e-6, **options):
    from jaxinfer.kernels.attention.decode_pallas import paged_decode_attention
    from jaxinfer.kernels.attention.rotary_pallas import rotary_cache_write

    q, k_cache, v_cache = rotary_cache_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_norm=q_norm,
                                             k_norm=k_norm, norm_eps=norm_eps)
    return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, **options), k_cache, v_cache


@contextlib.contextmanager
def _patched(module, attribute: str, value):
    saved = getattr(module, attribute)
    setattr(module, attribute, value)
    try:
        yield
    finally:
        setattr(module, attribute, saved)


def _replaced(op: str, fn, *, pallas: bool = True):
    """Serve ``op`` with ``fn`` while the variant's engine compiles (``registry.variant``)."""
    from jaxinfer.kernels import registry

    return registry.variant(op, fn, pallas=pallas)


# XLA's default command-buffer commands (jaxlib 0.11) plus the control flow ones.
GRAPH_LOOP_OPTIONS = {"xla_gpu_enable_command_buffer":
                      "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"}


def compiler_options(name: str) -> dict:
    """The XLA options the variant's executables compile with (none for most)."""
    parts = name.split("+")
    options = dict(GRAPH_LOOP_OPTIONS) if "graph-loop" in parts else {}
    if "xla-sort" in parts:  # XLA's own sort kernels, which a CUDA graph can hold, instead of CUB's
        options["xla_gpu_enable_cub_radix_sort"] = False
    return options


def _greedy_sample(logits, batch, num_logprobs=None, all_greedy=False):
    import jax.numpy as jnp

    return jnp.argmax(logits, axis=-1).astype(jnp.int32), None


def variant_context(name: str):
    parts = name.split("+")
    if len(parts) > 1:
        stack = contextlib.ExitStack()
        for part in parts:
            stack.enter_context(variant_context(part))
        return stack
    if name in ("graph-loop", "xla-sort", "logprobs"):  # compiler options / engine settings only
        return contextlib.nullcontext()
    if name == "one-sampler-loop":
        from jaxinfer.engine import runner, sampling

        def full_sampler(logits, batch, num_logprobs=None, all_greedy=False):
            return sampling.sample(logits, batch, num_logprobs)

        return _patched(runner, "sample", full_sampler)
    if name == "greedy-sampler":
        from jaxinfer.engine import runner

        return _patched(runner, "sample", _greedy_sample)
    if name == "unchecked-logits":
        import jax.numpy as jnp

        from jaxinfer.engine import runner, sampling

        def unchecked(logits, batch, num_logprobs=None, all_greedy=False):
            greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            tokens = greedy if all_greedy else sampling._draw(logits, greedy, batch)
            return tokens, sampling._logprobs(logits, tokens, batch, num_logprobs)

        return _patched(runner, "sample", unchecked)
    if name == "unfused-rotary-decode":
        return _replaced("attention.rotary_paged_decode_attention", _unfused_rotary_decode)
    if name in ("skinny-router", "skinny-one-row"):
        from jaxinfer.kernels.linear import reference as linear_reference
        from jaxinfer.kernels.linear import skinny_pallas

        widest = 1024 if name == "skinny-router" else 65535  # the router alone; also the o projection

        def project(x, weights, biases=None, **options):
            rows = x.size // x.shape[-1]
            if rows == 1 and (len(weights) > 1 or weights[0].shape[0] <= widest):
                return skinny_pallas.project(x, weights, biases, **options)
            return linear_reference.project(x, weights, biases)

        return _replaced("linear.project", project)
    if name == "moe-down-four-stages":
        from jaxinfer.kernels.moe import grouped_pallas

        return _replaced("moe.moe_mlp", functools.partial(grouped_pallas.moe_mlp,
                                                           down_tuning=grouped_pallas.KernelTuning(num_stages=4)))
    if name == "unfused-norm-project":
        return _replaced("linear.norm_project", _norm_then_project, pallas=False)
    if name.startswith(("decode-blocks-", "decode-splits-")):
        from jaxinfer.kernels.attention import decode_pallas

        option = "block_tokens" if name.startswith("decode-blocks-") else "num_splits"
        return _replaced("attention.rotary_paged_decode_attention",
                         functools.partial(decode_pallas.rotary_paged_decode_attention,
                                           **{option: int(name.rsplit("-", 1)[1])}))
    if name == "decode-kv-first" or name.startswith("decode-warps-"):
        from jaxinfer.kernels.attention import decode_pallas

        option = dict(kv_reads_first=True) if name == "decode-kv-first" else dict(num_warps=int(name.rsplit("-", 1)[1]))
        return _replaced("attention.rotary_paged_decode_attention",
                         functools.partial(decode_pallas.rotary_paged_decode_attention, **option))
    if name == "norm-project-8x2048":
        return _replaced("linear.norm_project", _norm_project_blocked(8, 2048), pallas=False)
    if name.startswith("trigger-"):
        return pdl.trigger_points(_trigger_points(name))
    raise ValueError(f"unknown variant {name!r}")


def _norm_project_blocked(block_n: int, block_k: int):
    """``linear.norm_project`` as dispatched on the GPU, with the one-row kernel's blocking set."""
    from jaxinfer.kernels.linear import skinny_pallas

    def norm_project(x, residual, norm_weight, weights, biases=None, *, eps, unit_offset=False, float32_weight=False):
        if len(weights) > 1 and x.size == x.shape[-1]:
            width = min(block_k, 1 << (x.shape[-1] - 1).bit_length())
            steps = -(-x.shape[-1] // width)
            blocking = skinny_pallas.Blocking(block_n, width, num_warps=4, num_stages=1 if steps == 1 else 3)
            summed = x if residual is None else x + residual
            return skinny_pallas.norm_project(summed, norm_weight, weights, biases, eps=eps, unit_offset=unit_offset,
                                              blocking=blocking), summed
        return _norm_then_project(x, residual, norm_weight, weights, biases, eps=eps, unit_offset=unit_offset,
                                  float32_weight=float32_weight)

    return norm_project


def _norm_then_project(x, residual, norm_weight, weights, biases=None, *, eps, unit_offset=False,
                       float32_weight=False):
    from jaxinfer.kernels import linear, norm

    normed, summed = norm.add_rms_norm(x, residual, norm_weight, eps, unit_offset=unit_offset,
                                       float32_weight=float32_weight)
    return linear.project(normed, weights, biases), summed


NAMED_VARIANTS = ("unfused-rotary-decode", "skinny-router", "skinny-one-row", "moe-down-four-stages",
                  "unfused-norm-project", "norm-project-8x2048", "graph-loop", "greedy-sampler", "xla-sort",
                  "logprobs", "one-sampler-loop", "moe-block-ops", "decode-kv-first", "unchecked-logits")
VARIANT_FORMS = ("decode-blocks-N", "decode-splits-N", "decode-warps-N", "trigger-FAMILY=POINT,...", "VARIANT+VARIANT")


def _trigger_points(name: str) -> dict[str, str]:
    """``trigger-a=start,b=none`` -> {"a": "start", "b": "none"}; ``all`` stands for every family."""
    points = {}
    for item in name.removeprefix("trigger-").split(","):
        family, _, point = item.partition("=")
        families = pdl.DEFAULT_POINTS if family == "all" else (family,)
        points.update({f: point for f in families})
    return points


def variant_name(name: str) -> str:
    """``name`` if it names a variant (for argparse), else a usage error."""
    if "+" in name:
        for part in name.split("+"):
            variant_name(part)
        return name
    if name in NAMED_VARIANTS:
        return name
    if name.startswith(("decode-blocks-", "decode-splits-", "decode-warps-")) and name.rsplit("-", 1)[1].isdigit():
        if int(name.rsplit("-", 1)[1]) < 1:  # 0 would silently fall back to the default blocking
            raise argparse.ArgumentTypeError(f"{name}: N must be at least 1")
        return name
    if name.startswith("trigger-"):
        try:
            pdl.check_points(_trigger_points(name))
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return name
    raise argparse.ArgumentTypeError(f"unknown variant {name!r}; choose from "
                                     f"{', '.join(NAMED_VARIANTS + VARIANT_FORMS)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b")
    parser.add_argument("--variant", type=variant_name, nargs="+", default=["unfused-rotary-decode"],
                        help=f"one or more of: {', '.join(NAMED_VARIANTS + VARIANT_FORMS)}")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    from jaxinfer.engine.engine import Engine

    max_len = args.context + args.steps + 16
    pages = args.batch * -(-max_len // 16) + 8  # a cache for these requests only: two engines share the GPU
    _, _, engine = build_engine(args.model, args.layers, steps=args.steps, max_len=max_len, max_seqs=args.batch,
                                batched_tokens=max(16, args.batch), num_pages=pages)
    compile_s = {}
    start = time.perf_counter()
    runs = {"main": (engine, *decode_requests(engine, args.batch, args.context, args.steps))}
    compile_s["main"] = time.perf_counter() - start
    for variant in args.variant:
        with variant_context(variant):  # the same weights behind another engine
            config = engine.config
            if "logprobs" in variant.split("+"):
                config = dataclasses.replace(config, max_logprobs=5)
            variant_engine = Engine(engine.model, config)
            variant_engine.runner.compiler_options = compiler_options(variant)
            start = time.perf_counter()
            runs[variant] = (variant_engine, *decode_requests(variant_engine, args.batch, args.context, args.steps))
            compile_s[variant] = time.perf_counter() - start  # tracing and compiling the decode program
    times = {name: [] for name in runs}
    tokens = {}
    for _ in range(args.rounds + 1):  # the first round warms up and is dropped
        for name, (eng, requests, key) in runs.items():
            start = time.perf_counter()
            tokens[name], _ = eng.runner.run_decode(key, requests)
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    result = {"environment": environment(), "model": args.model, "layers": args.layers, "batch": args.batch,
              "context": args.context, "steps_per_call": args.steps, "variants": args.variant,
              **{name: {"ms_per_step_median": float(np.median(t[1:])), "all": t[1:]} for name, t in times.items()},
              "ratio_to_main_median": {  # per round, so that drift shared by both calls of a round cancels
                  variant: float(np.median(np.asarray(times[variant][1:]) / np.asarray(times["main"][1:])))
                  for variant in args.variant},
              "compile_s": compile_s,
              "same_tokens": {variant: bool((np.asarray(tokens["main"]) == np.asarray(tokens[variant])).all())
                              for variant in args.variant},
              # the first step (of the last round's call) whose tokens differ, per sequence (-1: none)
              "first_different_step": {variant: [int(np.argmax(d)) if d.any() else -1 for d in
                                                 (np.asarray(tokens["main"]) != np.asarray(tokens[variant])).T]
                                       for variant in args.variant}}
    print(json.dumps(result), flush=True)
    label = f"{len(args.variant)}_variants" if len(args.variant) > 1 else args.variant[0]
    label = label.replace("=", "-").replace(",", "_")  # a plain file name
    write_json(f"decode_ab_{args.model}_b{args.batch}_{label}.json", result)


if __name__ == "__main__":
    main()
