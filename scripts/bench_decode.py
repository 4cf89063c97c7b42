r"""Whole-model decode on the GPU through the engine's decode loop, next to its roofline and HF.

A model with random bf16 weights decodes ``--steps`` tokens per device call at each (batch,
context): ``--model llama3-8b`` (32 layers, hidden 4096, 32/8 heads, vocab 128256),
``--model qwen3-30b-a3b`` (48 layers, hidden 2048, 32/4 heads, 128 experts of width 768, top-8),
``--model deepseek-v3`` (61 layers, hidden 7168, 128 MLA heads over a 512 + 64 latent, 256 experts
of width 2048, top-8 in 4 of 8 groups, a shared expert, the first 3 layers dense, vocab 129280) or
``--model qwen3-next`` (Qwen3-Next-80B-A3B: 48 layers, 3 gated-DeltaNet layers of 16/32 heads of 128
to each gated full-attention layer of 16/2 heads of 256, 512 experts of width 512, top-10, a gated
shared expert, vocab 151936). Neither of the last two fits one GPU at its real depth (bf16 weights:
DeepSeek-V3 22.5 GB per MoE layer; Qwen3-Next 159 GB at 48 layers): give ``--layers``. A shallower
DeepSeek-V3 keeps ``min(3, max(1, layers // 4))`` dense layers (at 4 layers one dense and three MoE,
74 GB); a shallower Qwen3-Next keeps the full-attention layer every 4th (below 4 layers, the last
one; 14 GB at 4 layers).

The roofline of one step is the bytes it must read over the copy bandwidth measured in the same run:
every dense weight (shared experts included), the experts the step's tokens touch (for MoE: the
expected number of distinct experts when each token picks top-k uniformly at random, per layer),
every sequence's paged cache (KV, or MLA's latent rows), and every sequence's state slot (the
linear-attention layers' recurrent and conv state), read and written once per step. The embedding
table counts whole (the convention of the README's tables), though a step reads one row of it per
sequence; ``x_roofline_without_embedding_table`` leaves out the rows it does not read (of an untied
table). HF transformers (PyTorch, eager, dynamic cache) runs the same model shape in a subprocess
(``--hf-batches`` with no values skips it).

Prefill TFLOP/s count the matmuls (2 x the parameters each token multiplies with) and attention per
layer kind: GQA 4 x heads x head_dim per query-key pair; MLA in its absorbed form 2 x heads x
(2 x kv_lora_rank + qk_rope_head_dim) per pair (scores over latent + rope, values over the latent),
a sparse layer's pairs capped at its top-k plus its indexer's 2 x index heads x index_head_dim per
pair; the linear-attention recurrences 6 (delta rules) or 4 (lightning) x heads x Dk x Dv per token
(what the token recurrence computes; the chunked forms do somewhat more). MLA prefill runs the
plain-jnp reference (it materialises every query's key rows: keep prompts short for deepseek-v3).

``--scale-down N`` divides every width (hidden, MLP, expert, head and latent widths, vocabulary) by
N, keeping the layer, head and expert counts, and measures the bandwidth over 64 MiB instead of
4 GiB: a smoke run of the script on a CPU, not a benchmark.

    PYTHONPATH=. python3 scripts/bench_decode.py                  # bench_decode_<model>.json in $JAXINFER_BENCH_DIR
    PYTHONPATH=. python3 scripts/bench_decode.py --layers 4       # a quicker, shallower model
    PYTHONPATH=. python3 scripts/bench_decode.py --model qwen3-30b-a3b --batches 1 32 --contexts 512 --hf-batches
    PYTHONPATH=. python3 scripts/bench_decode.py --model deepseek-v3 --layers 4 --batches 1 32 --contexts 4096 \
        --prefill 1x512 --hf-batches
    PYTHONPATH=. python3 scripts/bench_decode.py --model qwen3-next --layers 4 --scale-down 16 --batches 1 2 \
        --contexts 16 --steps 2 --repeats 1 --prefill 1x32   # CPU smoke run
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
from benchlib import KERNEL_FAMILIES, copy_bandwidth, device_time, environment, force_reference, write_json  # noqa: E402


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


def deepseek_v3_config(layers: int) -> dict:
    """DeepSeek-V3's config.json (YaRN over 4096 x 40, noaux_tc routing); the dense layers capped so
    that a shallow model keeps MoE layers."""
    return dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
                intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=128,
                num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
                n_shared_experts=1, first_k_dense_replace=min(3, max(1, layers // 4)), routed_scaling_factor=2.5,
                norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid", max_position_embeddings=163840,
                rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False, attention_bias=False,
                rope_interleave=True, bos_token_id=0, eos_token_id=1,
                rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
                                     original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                                     mscale_all_dim=1.0), dtype="bfloat16")


def qwen3_next_config(layers: int) -> dict:
    """Qwen3-Next-80B-A3B's config.json; every 4th layer full attention (the last one below 4 layers)."""
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    if layers < 4:
        layer_types[-1] = "full_attention"
    return dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=151936, hidden_size=2048,
                intermediate_size=5120, num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=2,
                head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10,
                moe_intermediate_size=512, shared_expert_intermediate_size=512, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[], full_attention_interval=4, layer_types=layer_types,
                max_position_embeddings=262144, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
                attention_bias=False, rope_parameters=dict(rope_type="default", rope_theta=10000000.0,
                                                           partial_rotary_factor=0.25), dtype="bfloat16")


MODELS = {"llama3-8b": llama3_8b_config, "qwen3-30b-a3b": qwen3_30b_a3b_config, "deepseek-v3": deepseek_v3_config,
          "qwen3-next": qwen3_next_config}
DEPTHS = {"llama3-8b": 32, "qwen3-30b-a3b": 48, "deepseek-v3": 61, "qwen3-next": 48}  # the real models'
# The widths ``--scale-down`` divides (a CPU smoke run); layer, head and expert counts stay.
_WIDTHS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
           "head_dim", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
           "linear_key_head_dim", "linear_value_head_dim")


def model_config(model_name: str, layers: int, scale_down: int = 1) -> dict:
    """``model_name``'s config.json fields at ``layers`` layers, every width divided by ``scale_down``
    (rounded down to an even number, at least 2)."""
    fields = MODELS[model_name](layers)
    if scale_down > 1:
        fields.update({k: max(2, fields[k] // scale_down // 2 * 2) for k in _WIDTHS if fields.get(k)})
    return fields


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


def _layer_specs(config):
    from jaxinfer.registry import ModelRegistry

    return ModelRegistry.resolve(config.architecture).spec(config).layers


def _routed(config) -> tuple[int, int]:
    """(routed experts, top-k) of the model's MoE layers, from its decoder spec (each family's own
    names: num_experts, num_local_experts, n_routed_experts, ...)."""
    from jaxinfer.models.layers.moe import MoESpec

    (moe, *_) = [layer.ffn for layer in _layer_specs(config) if isinstance(layer.ffn, MoESpec)]
    return moe.num_experts, moe.top_k


def _expert_fraction(config, tokens: int) -> float:
    """Expected share of each layer's experts that ``tokens`` tokens touch (uniform top-k routing)."""
    num_experts, top_k = _routed(config)
    return 1 - (1 - top_k / num_experts) ** tokens


def step_weight_bytes(params, config, batch: int) -> float:
    """Bytes of weights one decode step reads: dense weights whole (shared experts are modules of their
    own, "shared_expert(s)", outside any "experts" one), routed experts only where touched."""
    dense, experts = _dense_and_expert_sizes(params, bytes_=True)
    return dense + (experts * _expert_fraction(config, batch) if experts else 0)


def unread_embedding_bytes(params, config, batch: int) -> float:
    """Bytes of the input embedding table that ``step_weight_bytes`` counts and a decode step of
    ``batch`` tokens does not read (all but their rows), unless the LM head reads the table (tied)."""
    from flax import traverse_util

    if config.tie_word_embeddings:
        return 0.0
    table = [x for path, x in traverse_util.flatten_dict(params).items() if "embed_tokens" in path]
    return sum(x.size * x.dtype.itemsize * (1 - min(batch, x.shape[0]) / x.shape[0]) for x in table)


def matmul_params_per_token(params, config) -> float:
    """Parameters each token multiplies with: dense ones (less the embedding lookup) and its top-k experts.
    MLA's kv_b_proj counts once: absorbed, each token's q_nope goes through W_UK and its output through W_UV."""
    dense, experts = _dense_and_expert_sizes(params, bytes_=False)
    dense -= config.vocab_size * config.hidden_size
    if experts:
        num_experts, top_k = _routed(config)
        dense += experts * top_k / num_experts
    return dense


def _pairs(length: int, cap: int | None) -> float:
    """Causal query-key pairs of a ``length``-token prompt, each query seeing at most ``cap`` keys
    (``length ** 2 / 2`` uncapped)."""
    cap = length if cap is None else min(cap, length)
    return cap * length - cap * cap / 2


def attention_flops(config, batch: int, length: int) -> float | None:
    """FLOPs of attention and recurrences (beyond the projections) in a prefill of ``batch`` prompts of
    ``length`` tokens, per layer kind (the module docstring's counts); None for a mixer not counted here."""
    from jaxinfer.models.layers.attention import GQA
    from jaxinfer.models.layers.gated_deltanet import GatedDeltaNet
    from jaxinfer.models.layers.kda import KDA
    from jaxinfer.models.layers.lightning import LightningAttention
    from jaxinfer.models.layers.mla import MLA

    heads, total = config.num_attention_heads, 0.0
    for layer in _layer_specs(config):
        mixer = layer.mixer
        if isinstance(mixer, GQA):
            total += 4 * heads * config.head_dim * _pairs(length, mixer.sliding_window)
        elif isinstance(mixer, MLA):
            sparse = mixer.indexer is not None or mixer.shares_selection
            top_k = config.int_field("index_topk") if sparse else None
            total += 2 * heads * (2 * mixer.kv_lora_rank + mixer.qk_rope_head_dim) * _pairs(length, top_k)
            if mixer.indexer is not None:
                total += 2 * mixer.indexer.num_heads * mixer.indexer.head_dim * _pairs(length, None)
        elif isinstance(mixer, GatedDeltaNet):
            s = mixer.sizes(config)
            total += 6 * s["num_value_heads"] * s["key_head_dim"] * s["value_head_dim"] * length
        elif isinstance(mixer, KDA):
            s = mixer.sizes(config)
            total += 6 * s["num_heads"] * s["head_dim"] ** 2 * length
        elif isinstance(mixer, LightningAttention):
            total += 4 * heads * config.head_dim ** 2 * length
        else:
            return None
    return batch * total


def build_engine(model_name: str, layers: int, *, steps: int, max_len: int, max_seqs: int, batched_tokens: int,
                 num_pages: int | None = None, scale_down: int = 1, dtype=jnp.bfloat16):
    """A model of ``model_name``'s shape (widths divided by ``scale_down``) with random weights of
    ``dtype`` (bf16), behind an engine (no warm-up)."""
    from jaxinfer.config import ModelConfig
    from jaxinfer.engine.config import EngineConfig
    from jaxinfer.engine.engine import Engine
    from jaxinfer.loader import in_memory_model
    from jaxinfer.registry import ModelRegistry
    from jaxinfer.weights import init_params

    config = ModelConfig.from_dict(model_config(model_name, layers, scale_down))
    model_cls = ModelRegistry.resolve(config.architecture)
    params = init_params(model_cls, config, seed=0, dtype=dtype)
    model = in_memory_model(model_cls, config, params, dtype, path="<random>")
    engine_config = EngineConfig(max_model_len=max_len, max_num_seqs=max_seqs, max_num_batched_tokens=batched_tokens,
                                 decode_steps=steps, warmup=False, show_progress=False, max_logprobs=None,
                                 num_pages=num_pages,
                                 # a prompt of the full trained length plus its sampled token and the
                                 # headroom above: positions past it are harmless with random weights
                                 allow_long_max_model_len=True)
    return config, params, Engine(model, engine_config)


def decode_requests(engine, batch: int, context: int, steps: int):
    """``batch`` requests whose ``context`` tokens count as already in the cache (each with a state
    slot, for models with per-sequence state), and the decode loop's compile key for them (compiled).
    Decode cost does not depend on the cached values. ``release`` gives their pages and slots back."""
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
        r.slot = _allocate_slot(engine)
        requests.append(r)
    grid = engine.grid
    num_seqs = bucket_for(batch, grid.seq_buckets)
    key = CompileKey(DECODE, num_seqs, num_seqs, bucket_for(len(requests[0].pages), grid.page_buckets))
    engine.runner.compile(key)
    return requests, key


def _allocate_slot(engine) -> int | None:
    slots = engine.scheduler.slots
    return None if slots is None else slots.allocate()


def release(engine, requests) -> None:
    """Give the requests' pages and state slots back to the engine's pools."""
    for r in requests:
        engine.scheduler.allocator.free(r.pages)
        if engine.scheduler.slots is not None:
            engine.scheduler.slots.free(r.slot)
        r.pages, r.slot = [], None


def small_copy_bandwidth() -> float:
    """Bytes/s of ``a * 2`` over 64 MiB of float32 (a smoke run's stand-in for ``copy_bandwidth``)."""
    a = jnp.ones((16, 1024, 1024), jnp.float32)
    return 2 * a.size * 4 / device_time(lambda x: x * 2, a, iters=5, repeats=3)


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
                                          num_pages=args.num_pages, scale_down=args.scale_down,
                                          dtype=jnp.dtype(args.dtype))
    engine_config = engine.config
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    kv_bytes_per_token = engine.layout.bytes_per_page // engine.layout.page_size  # paged: KV or MLA latent rows
    state_bytes_per_seq = engine.layout.bytes_per_slot  # linear-attention state, read and written every step
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
            state_bytes = batch * 2 * state_bytes_per_seq
            kv_bytes = batch * (context + args.steps / 2) * kv_bytes_per_token
            read_bytes = step_weight_bytes(params, config, batch) + kv_bytes + state_bytes
            roofline = read_bytes / bandwidth
            reads = (read_bytes - unread_embedding_bytes(params, config, batch)) / bandwidth
            rows.append({"batch": batch, "context": context, "ms_per_step": step * 1e3, "tok_per_s": batch / step,
                         "roofline_ms": roofline * 1e3, "x_roofline": step / roofline,
                         "x_roofline_without_embedding_table": step / reads, "state_bytes": state_bytes})
            print(rows[-1], flush=True)
            save({"rows": rows})
            release(engine, requests)
    prefill_rows = []
    for batch, length in args.prefill:
        requests = []
        for i in range(batch):
            r = Request(i, list(np.random.RandomState(i).randint(0, config.vocab_size, length)), greedy, seed=i,
                        stop_ids=(), max_output_tokens=1)
            r.pages = engine.scheduler.allocator.allocate(-(-length // engine.layout.page_size))
            r.slot = _allocate_slot(engine)
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
        mixer_flops = attention_flops(config, batch, length)
        tflops = None if mixer_flops is None else (matmul_flops + mixer_flops) / seconds / 1e12
        prefill_rows.append({"batch": batch, "prompt": length, "seconds": seconds, "tok_per_s": batch * length / seconds,
                             "tflops": tflops})
        print(prefill_rows[-1], flush=True)
        save({"rows": rows, "prefill": prefill_rows})
        release(engine, requests)
    return {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes_per_token,
            "state_bytes_per_sequence": state_bytes_per_seq, "num_pages": engine.layout.num_pages,
            "num_slots": engine.layout.num_slots, "rows": rows, "prefill": prefill_rows}


def bench_hf(model_name, layers, batches, context, new_tokens):
    import torch
    import transformers

    torch.set_default_dtype(torch.bfloat16)
    fields = model_config(model_name, layers)
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
    parser.add_argument("--hf-batches", type=int, nargs="*", default=[1, 32],
                        help="batches for HF transformers (needs CUDA); with no values, HF is not run")
    parser.add_argument("--hf-context", type=int, default=512)
    parser.add_argument("--hf-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--scale-down", type=int, default=1, metavar="N",
                        help="divide every width by N and measure bandwidth over 64 MiB: a CPU smoke run (no HF)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="weights and cache (float32: for CPU smoke runs where XLA's CPU bf16 dots fail)")
    args = parser.parse_args()
    args.prefill = [tuple(int(x) for x in shape.split("x")) for shape in args.prefill]
    if args.layers is None:
        args.layers = DEPTHS[args.model]
    if args.hf_only:
        print(json.dumps(bench_hf(args.model, args.layers, args.hf_batches, args.hf_context, args.steps)))
        return
    result = {"environment": environment(), "model": args.model, "layers": args.layers, "steps_per_call": args.steps}
    if args.scale_down > 1 or args.dtype != "bfloat16":
        result.update(scale_down=args.scale_down, dtype=args.dtype, smoke_run=True)
        args.hf_batches = []  # HF runs the real shapes on CUDA
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
    result["copy_bandwidth_TBps"] = (small_copy_bandwidth() if args.scale_down > 1 else copy_bandwidth()) / 1e12
    def save(partial):
        result["jaxinfer"] = partial
        write_json(f"bench_decode_{args.model}.json", result)

    result["jaxinfer"] = bench_jax(args, result["copy_bandwidth_TBps"] * 1e12, save)
    print("wrote", write_json(f"bench_decode_{args.model}.json", result))


if __name__ == "__main__":
    main()
