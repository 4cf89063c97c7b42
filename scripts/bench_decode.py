"""Whole-model decode on the GPU through the engine's decode loop, next to its roofline and HF.

A model with random bf16 weights decodes ``--steps`` tokens per device call at each (batch,
context): ``--model llama3-8b`` (32 layers, hidden 4096, 32/8 heads, vocab 128256) or
``--model qwen3-30b-a3b`` (48 layers, hidden 2048, 32/4 heads, 128 experts of width 768, top-8).
The roofline of one step is the bytes it must read over the copy bandwidth measured in the same run:
every dense weight, the experts the step's tokens touch (for MoE: the expected number of distinct
experts when each token picks top-k uniformly at random, per layer), and every sequence's KV cache.
HF transformers (PyTorch, eager, dynamic cache) runs the same model shape in a subprocess.

    PYTHONPATH=. python3 scripts/bench_decode.py                  # bench_decode_<model>.json in $JAXINFER_BENCH_DIR
    PYTHONPATH=. python3 scripts/bench_decode.py --layers 4       # a quicker, shallower model
    PYTHONPATH=. python3 scripts/bench_decode.py --model qwen3-30b-a3b --batches 1 32 --contexts 512 --hf-batches
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import KERNEL_FAMILIES, copy_bandwidth, environment, force_reference, write_json  # noqa: E402


def llama3_8b_config(layers: int) -> dict:
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5, hidden_act="silu",
                tie_word_embeddings=False, rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192), dtype="bfloat16")


def qwen3_30b_a3b_config(layers: int) -> dict:
    return dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                norm_topk_prob=True, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4,
                head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, hidden_act="silu",
                tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
                dtype="bfloat16")


MODELS = {"llama3-8b": llama3_8b_config, "qwen3-30b-a3b": qwen3_30b_a3b_config}


def _dense_and_expert_sizes(params, bytes_: bool) -> tuple[int, int]:
    from flax import traverse_util

    dense, experts = 0, 0
    for path, x in traverse_util.flatten_dict(params).items():
        size = x.size * (x.dtype.itemsize if bytes_ else 1)
        if "experts" in path:
            experts += size
        else:
            dense += size
    return dense, experts


def _expert_fraction(config, tokens: int) -> float:
    """Expected share of each layer's experts that ``tokens`` tokens touch (uniform top-k routing)."""
    num_experts, top_k = config.require("num_experts", "num_local_experts"), config.require("num_experts_per_tok")
    return 1 - (1 - top_k / num_experts) ** tokens


def step_weight_bytes(params, config, batch: int) -> float:
    """Bytes of weights one decode step reads: dense weights whole, experts only where touched."""
    dense, experts = _dense_and_expert_sizes(params, bytes_=True)
    return dense + (experts * _expert_fraction(config, batch) if experts else 0)


def matmul_params_per_token(params, config) -> float:
    """Parameters each token multiplies with: dense ones (less the embedding lookup) and its top-k experts."""
    dense, experts = _dense_and_expert_sizes(params, bytes_=False)
    dense -= config.vocab_size * config.hidden_size
    if experts:
        dense += experts * config.require("num_experts_per_tok") / config.require("num_experts", "num_local_experts")
    return dense


def build_engine(model_name: str, layers: int, *, steps: int, max_len: int, max_seqs: int, batched_tokens: int,
                 num_pages: int | None = None):
    """A model of ``model_name``'s shape with random bf16 weights, behind an engine (no warm-up)."""
    from jaxinfer.config import ModelConfig
    from jaxinfer.engine.config import EngineConfig
    from jaxinfer.engine.engine import Engine
    from jaxinfer.loader import LoadedModel
    from jaxinfer.registry import ModelRegistry
    from jaxinfer.sharding import make_mesh
    from jaxinfer.weights import init_params

    config = ModelConfig.from_dict(MODELS[model_name](layers))
    model_cls = ModelRegistry.resolve(config.architecture)
    params = init_params(model_cls, config, seed=0, dtype=jnp.bfloat16)
    model = LoadedModel("<random>", config, model_cls, model_cls(config, jnp.bfloat16), params, make_mesh(), jnp.bfloat16)
    engine_config = EngineConfig(max_model_len=max_len, max_num_seqs=max_seqs, max_num_batched_tokens=batched_tokens,
                                 decode_steps=steps, warmup=False, show_progress=False, max_logprobs=None,
                                 num_pages=num_pages)
    return config, params, Engine(model, engine_config)


def decode_requests(engine, batch: int, context: int, steps: int):
    """``batch`` requests whose ``context`` tokens count as already in the cache, and the decode
    loop's compile key for them (compiled). Decode cost does not depend on the cached values."""
    from jaxinfer.engine.aot import DECODE, CompileKey
    from jaxinfer.engine.config import bucket_for
    from jaxinfer.engine.request import Request
    from jaxinfer.engine.sampling import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    requests = []
    for i in range(batch):
        r = Request(i, [1] * context, greedy, seed=i, stop_ids=(), max_output_tokens=steps + 1)
        # A token of its own per sequence: identical inputs would route every sequence of a MoE
        # model to the same experts and read far fewer expert bytes than real traffic.
        r.output_token_ids = [1 + i]
        r.num_computed = context
        r.pages = engine.scheduler.allocator.allocate(-(-(context + steps) // engine.layout.page_size))
        requests.append(r)
    grid = engine.grid
    num_seqs = bucket_for(batch, grid.seq_buckets)
    key = CompileKey(DECODE, num_seqs, num_seqs, bucket_for(len(requests[0].pages), grid.page_buckets))
    engine.runner.compile(key)
    return requests, key


def bench_jax(args, bandwidth, save):
    from jaxinfer.engine.aot import MIXED, CompileKey
    from jaxinfer.engine.config import bucket_for
    from jaxinfer.engine.request import Request
    from jaxinfer.engine.sampling import SamplingParams

    prefill_tokens = max([b * n for b, n in args.prefill] or [0])
    max_len = max([max(args.contexts) + args.steps] + [n for _, n in args.prefill]) + 16
    max_seqs = max(args.batches + [b for b, _ in args.prefill])
    config, params, engine = build_engine(args.model, args.layers, steps=args.steps, max_len=max_len,
                                          max_seqs=max_seqs, batched_tokens=max(max_seqs, prefill_tokens),
                                          num_pages=args.num_pages)
    engine_config = engine.config
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    kv_bytes_per_token = engine.layout.bytes_per_page // engine.layout.page_size
    rows = []
    greedy = SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True)
    for context in args.contexts:
        for batch in args.batches:
            if batch * (context + args.steps) > engine.layout.num_pages * engine.layout.page_size:
                continue
            requests, key = decode_requests(engine, batch, context, args.steps)
            engine.runner.run_decode(key, requests)  # warm
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                tokens, _ = engine.runner.run_decode(key, requests)
                times.append(time.perf_counter() - start)
            assert (tokens >= 0).all()
            step = float(np.median(times)) / args.steps
            read_bytes = step_weight_bytes(params, config, batch) + batch * (context + args.steps / 2) * kv_bytes_per_token
            roofline = read_bytes / bandwidth
            rows.append({"batch": batch, "context": context, "ms_per_step": step * 1e3, "tok_per_s": batch / step,
                         "roofline_ms": roofline * 1e3, "x_roofline": step / roofline})
            print(rows[-1], flush=True)
            save({"rows": rows})
            for r in requests:
                engine.scheduler.allocator.free(r.pages)
    prefill_rows = []
    for batch, length in args.prefill:
        requests = []
        for i in range(batch):
            r = Request(i, list(np.random.RandomState(i).randint(0, config.vocab_size, length)), greedy, seed=i,
                        stop_ids=(), max_output_tokens=1)
            r.pages = engine.scheduler.allocator.allocate(-(-length // engine.layout.page_size))
            requests.append(r)
        items = [(r, length) for r in requests]
        key = CompileKey(MIXED, bucket_for(batch * length, engine.grid.token_buckets), engine_config.max_num_seqs,
                         engine_config.max_pages_per_seq)
        engine.runner.compile(key)
        engine.runner.run_mixed(key, items)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            engine.runner.run_mixed(key, items)
            times.append(time.perf_counter() - start)
        seconds = float(np.median(times))
        matmul_flops = 2 * matmul_params_per_token(params, config) * batch * length
        attention_flops = 4 * batch * length * length / 2 * config.num_attention_heads * config.head_dim * args.layers
        prefill_rows.append({"batch": batch, "prompt": length, "seconds": seconds, "tok_per_s": batch * length / seconds,
                             "tflops": (matmul_flops + attention_flops) / seconds / 1e12})
        print(prefill_rows[-1], flush=True)
        save({"rows": rows, "prefill": prefill_rows})
        for r in requests:
            engine.scheduler.allocator.free(r.pages)
    return {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes_per_token,
            "num_pages": engine.layout.num_pages, "rows": rows, "prefill": prefill_rows}


def bench_hf(model_name, layers, batches, context, new_tokens):
    import torch
    import transformers

    torch.set_default_dtype(torch.bfloat16)
    fields = dict(MODELS[model_name](layers))
    fields.pop("architectures")
    hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    rows = []
    for batch in batches:
        ids = torch.randint(0, hf_config.vocab_size, (batch, context), device="cuda")

        def run(n):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            return time.perf_counter() - start

        run(2)
        step = (run(new_tokens) - run(1)) / (new_tokens - 1)
        rows.append({"batch": batch, "context": context, "ms_per_step": step * 1e3, "tok_per_s": batch / step})
        print(rows[-1], flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    parser.add_argument("--layers", type=int, default=None, help="default: the real model's depth")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-pages", type=int, default=None, help="KV pages (default: the engine's)")
    parser.add_argument("--prefill", nargs="*", default=["1x8192", "16x1024"], help="prefill shapes, BATCHxLENGTH")
    parser.add_argument("--reference", nargs="*", default=[], choices=KERNEL_FAMILIES,
                        help="op families to run as their jnp references instead of the GPU kernels")
    parser.add_argument("--hf-batches", type=int, nargs="*", default=[1, 32])
    parser.add_argument("--hf-context", type=int, default=512)
    parser.add_argument("--hf-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.prefill = [tuple(int(x) for x in shape.split("x")) for shape in args.prefill]
    if args.layers is None:
        args.layers = {"llama3-8b": 32, "qwen3-30b-a3b": 48}[args.model]
    if args.hf_only:
        print(json.dumps(bench_hf(args.model, args.layers, args.hf_batches, args.hf_context, args.steps)))
        return
    result = {"environment": environment(), "model": args.model, "layers": args.layers, "steps_per_call": args.steps}
    if args.hf_batches:
        # PyTorch first, in its own process, so the two frameworks never share the GPU's memory.
        cmd = [sys.executable, __file__, "--hf-only", "--model", args.model, "--layers", str(args.layers),
               "--hf-context", str(args.hf_context), "--steps", str(args.steps),
               "--hf-batches", *map(str, args.hf_batches)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        result["hf"] = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"error": out.stderr[-2000:]}
        print("hf", result["hf"], flush=True)
    if args.reference:
        force_reference(args.reference)
        result["reference_ops"] = args.reference
    result["copy_bandwidth_TBps"] = copy_bandwidth() / 1e12
    def save(partial):
        result["jaxinfer"] = partial
        write_json(f"bench_decode_{args.model}.json", result)

    result["jaxinfer"] = bench_jax(args, result["copy_bandwidth_TBps"] * 1e12, save)
    print("wrote", write_json(f"bench_decode_{args.model}.json", result))


if __name__ == "__main__":
    main()
