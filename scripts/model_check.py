"""The GPU kernels inside the engine, end to end, in bfloat16: each family's random checkpoint generates
greedily with the kernels (the GPU default), and with every op's plain-jnp reference in bfloat16 and
in float32; the kernels must be as close to the float32 run as the bfloat16 reference is.

The kernel checks (``gpu_check.py``, ``moe_check.py``) compare each kernel with its reference op by op;
the float32 model tests compare the references with transformers. This closes the gap between them:
whole models at head_dim 128 in bfloat16 (the dtype the Mosaic GPU prefill kernel takes), ragged
prompts that are not multiples of the page size, chunked over several prefill steps, then decode
steps, through the engine's own scheduler, cache and compiled buckets. The checkpoints hold
bfloat16-representable weights, so the float32 run computes with the same weights. The reference runs
happen in processes of their own (the op dispatchers are chosen when the engine traces its steps).

bfloat16 results drift from float32 ones (sums in another order, rounded intermediates), and a
near-tie may flip a token, after which the runs are not comparable. So each bfloat16 run is compared
with the float32 run over the tokens all three runs agree on: the largest difference of the chosen
tokens' logprobs (its *drift*). The first token comes from the prefill kernels, the rest from the
decode kernels. A family passes where the kernels' largest drift over its requests is at most twice
the bfloat16 reference's plus 0.01. The verdict is per family, not per request: a near-tie among a
MoE router's scores flips an expert in one bfloat16 run and not the other, which moves that request's
logprobs far more than rounding does (random routers score experts closely). On the H200 the bfloat16
reference itself drifted 0.13 on one MiniMax-M2 request and 0.006 on another, the kernels 0.009 and
0.07 on the same two. A request whose kernels' run picks another first token than float32's (a
near-tie: float32's top two logprobs 0.012 apart on one Llama prompt) is compared at that token:
float32 must rank the kernels' pick second, and the difference of the two runs' logprobs of that
token counts as the kernels' drift.

The families: the first five as recorded; then the MLA ones at DeepSeek's latent widths (kv_lora_rank
512 + rope 64, 16 heads; DeepSeek-V3 and V3.2 with their YaRN scale, a dense layer then an MoE one
with grouped routing; the sparse ones keep 128 keys per query, fewer than every prompt has; GLM-5
at its own head widths, a "full" indexer layer then a "shared" one), the linear-attention hybrids at
heads of 128 (Qwen3-Next and Qwen3.5-MoE: 3 gated-DeltaNet layers of 4/8 heads, then a gated
full-attention layer of head_dim 256 as theirs; Kimi Linear: 3 KDA layers of 8 heads, then a NoPE
MLA layer, the first layer dense; MiniMax-Text-01: a lightning layer then a softmax one, with its
scaled residuals).

``--smoke`` divides the widths by 8 and the prompts by 10 (fewer tokens per step, so prefill still
spans several steps): a quick run of the script itself, e.g. on a CPU, where the "kernels" run is
the reference. ``--smoke-dtype float32`` runs the bfloat16 runs in float32, a smoke test of the
script's path without bfloat16 rounding.

``--kv-cache-dtype fp8`` serves the kernels' run with an fp8 (e4m3) KV cache (``jaxinfer.cache.fp8``),
the references keeping theirs in the compute dtype: the drift then includes the cache's e4m3 rounding,
judged by the same rule.

    PYTHONPATH=. python3 scripts/model_check.py          # writes model_check.json to $JAXINFER_BENCH_DIR (or .)
    PYTHONPATH=. python3 scripts/model_check.py --seed 1 # other random checkpoints and prompts
    PYTHONPATH=. python3 scripts/model_check.py --families deepseek_v3 kimi_linear minimax
    PYTHONPATH=. python3 scripts/model_check.py --smoke --families glm_moe_dsa  # a quick run, e.g. on a CPU
    PYTHONPATH=. python3 scripts/model_check.py --kv-cache-dtype fp8  # the kernels over an fp8 KV cache
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import KERNEL_FAMILIES, environment, force_reference, write_json  # noqa: E402

_SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, head_dim=128, max_position_embeddings=4096, dtype="bfloat16")
# MLA at DeepSeek's per-head widths (every head expanded from the latent: as many KV heads as heads).
_MLA = dict(num_attention_heads=16, num_key_value_heads=16, head_dim=None, q_lora_rank=1536, kv_lora_rank=512,
            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
_YARN = dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,  # DeepSeek-V3's
                                  original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                                  mscale_all_dim=1.0))
# A dense first layer, then MoE routed within 4 of 8 groups, plus a shared expert.
_DEEPSEEK_MOE = dict(n_routed_experts=32, num_experts_per_tok=4, moe_intermediate_size=256, n_shared_experts=1,
                     n_group=8, topk_group=4, first_k_dense_replace=1, routed_scaling_factor=2.5)
_SPARSE_TOP_K = 128  # fewer than every prompt's tokens: the selection drops keys
# Three gated-DeltaNet layers (heads of 128), then gated full attention at head_dim 256 (rotary 64).
_GATED_DELTANET = dict(num_hidden_layers=4, head_dim=256, linear_num_key_heads=4, linear_num_value_heads=8,
                       linear_key_head_dim=128, linear_value_head_dim=128, num_experts=32, num_experts_per_tok=4,
                       moe_intermediate_size=256, shared_expert_intermediate_size=256)
_MINIMAX_ALPHA = (2 * 80) ** 0.25  # MiniMax-Text-01's residual factors: (2 x its 80 layers) ** 0.25, beta 1
FAMILIES = {  # family -> its tiny checkpoint's overrides (the families' distinct ops, at realistic head sizes)
    "llama": {},
    "qwen3": {},  # per-head q/k norm fused into RoPE + cache write, tied embeddings
    "mistral": dict(sliding_window=384),  # windowed prefill (the Triton kernel) and decode
    "qwen3_moe": dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256),
    "minimax_m2": dict(num_local_experts=32, num_experts_per_tok=4, intermediate_size=256, rotary_dim=64),
    "deepseek_v3": dict(**_MLA, **_DEEPSEEK_MOE, **_YARN),
    "deepseek_v32": dict(**_MLA, **_DEEPSEEK_MOE, **_YARN, index_n_heads=64, index_head_dim=128,
                         index_topk=_SPARSE_TOP_K),
    "glm_moe_dsa": dict(**{**_MLA, "q_lora_rank": 2048, "qk_nope_head_dim": 192, "v_head_dim": 256},  # GLM-5's
                        n_routed_experts=32, num_experts_per_tok=4, moe_intermediate_size=256, n_shared_experts=1,
                        n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, index_n_heads=32,
                        index_head_dim=128, index_topk=_SPARSE_TOP_K, indexer_types=["full", "shared"]),
    "qwen3_next": _GATED_DELTANET,
    "qwen3_5_moe": _GATED_DELTANET,
    "kimi_linear": dict(**{**_MLA, "q_lora_rank": None}, num_experts=32, num_experts_per_token=4,  # no q LoRA
                        moe_intermediate_size=256, num_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=4,
                        linear_attn_config=dict(kda_layers=[1, 2, 3], full_attn_layers=[4], num_heads=8, head_dim=128,
                                                short_conv_kernel_size=4)),
    "minimax": dict(num_local_experts=32, num_experts_per_tok=2, intermediate_size=256, block_size=256,
                    **{f"{kind}_{factor}_factor": value for kind in ("full_attn", "linear_attn", "mlp")
                       for factor, value in (("alpha", _MINIMAX_ALPHA), ("beta", 1.0))}),
}
PROMPT_LENGTHS = (213, 700, 1500)
MAX_TOKENS = 24
MAX_MODEL_LEN, MAX_BATCHED_TOKENS = 2048, 1024
# --smoke: these widths divided by 8, index_topk too; the prompts and the step's tokens by 10.
_SMOKE_WIDTHS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                 "head_dim", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                 "index_head_dim", "index_topk", "linear_key_head_dim", "linear_value_head_dim")
RUNS = ("kernels", "reference_bfloat16", "reference_float32")


def checkpoint_shape(family: str, smoke: bool = False) -> dict:
    """The family's tiny-checkpoint overrides: ``_SHAPE`` and its own (widths / 8 for ``--smoke``)."""
    shape = {**_SHAPE, **FAMILIES[family]}
    if smoke:
        shape.update({k: shape[k] // 8 for k in _SMOKE_WIDTHS if shape.get(k)})
        if "linear_attn_config" in shape:
            shape["linear_attn_config"] = {**shape["linear_attn_config"],
                                           "head_dim": shape["linear_attn_config"]["head_dim"] // 8}
    return shape


def use_smoke_sizes() -> None:
    """Shorter prompts and runs for ``--smoke`` (the module's sizes, read by ``generate`` and ``compare``)."""
    global PROMPT_LENGTHS, MAX_TOKENS, MAX_MODEL_LEN, MAX_BATCHED_TOKENS
    PROMPT_LENGTHS = tuple(n // 10 for n in PROMPT_LENGTHS)
    MAX_TOKENS, MAX_MODEL_LEN, MAX_BATCHED_TOKENS = 8, 256, 64


def write_checkpoint(path: str, family: str, seed: int = 0, smoke: bool = False) -> None:
    """The family's tiny checkpoint at the check's shape, its weights rounded to bfloat16 values."""
    import jax.numpy as jnp
    from safetensors.numpy import load_file, save_file

    from jaxinfer.tiny import write_tiny_checkpoint

    write_tiny_checkpoint(path, family, seed=1 + seed, **checkpoint_shape(family, smoke))
    weights = os.path.join(path, "model.safetensors")
    rounded = {k: np.asarray(jnp.asarray(v, jnp.bfloat16).astype(jnp.float32)) for k, v in load_file(weights).items()}
    save_file(rounded, weights, metadata={"format": "pt"})


def generate(checkpoint: str, dtype: str, seed: int = 0, kv_cache_dtype: str = "auto") -> list[dict]:
    from jaxinfer import LLM, SamplingParams

    llm = LLM(checkpoint, dtype=dtype, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=MAX_BATCHED_TOKENS,
              show_progress=False, warmup=False,  # compile only the buckets these requests use
              kv_cache_dtype=kv_cache_dtype)
    rng = np.random.RandomState(seed)
    prompts = [rng.randint(3, llm.config.vocab_size, size=n).tolist() for n in PROMPT_LENGTHS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    # The chosen token's logprob, and the top two of the first position (JSON keys are strings).
    return [{"tokens": list(o.token_ids), "logprobs": [lp[t] for lp, t in zip(o.logprobs, o.token_ids)],
             "first_top": {str(t): lp for t, lp in o.logprobs[0].items()}} for o in outputs]


def _agreeing(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(runs: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for i, length in enumerate(PROMPT_LENGTHS):
        kernels, ref16, ref32 = (runs[name][i] for name in RUNS)
        kernels_agree, ref16_agree = (_agreeing(run["tokens"], ref32["tokens"]) for run in (kernels, ref16))
        common = min(kernels_agree, ref16_agree)

        def drift(run):
            return max((abs(a - b) for a, b in zip(run["logprobs"][:common], ref32["logprobs"][:common])), default=None)

        first_token_drift = None  # where the kernels' first token is not float32's but its runner-up
        if kernels_agree == 0 and str(kernels["tokens"][0]) in ref32.get("first_top", {}):
            first_token_drift = abs(kernels["logprobs"][0] - ref32["first_top"][str(kernels["tokens"][0])])
        rows.append({"prompt_tokens": length, "tokens_agreeing_with_float32": kernels_agree,
                     "reference_bfloat16_tokens_agreeing": ref16_agree, "compared_tokens": common,
                     "kernels_drift": drift(kernels), "reference_bfloat16_drift": drift(ref16),
                     "kernels_first_token_drift": first_token_drift})
    return rows


def family_passes(rows: list[dict]) -> bool:
    """The kernels drift at most twice as far as the bfloat16 reference (plus 0.01) over the family's
    requests, and every request has a token to compare: one all three runs agree on, or else the
    kernels' first token, where float32 ranks it second (a near-tie)."""
    kernel_drifts, reference_drifts = [], []
    for row in rows:
        if row["compared_tokens"]:
            kernel_drifts.append(row["kernels_drift"])
            reference_drifts.append(row["reference_bfloat16_drift"])
        elif row.get("kernels_first_token_drift") is not None:
            kernel_drifts.append(row["kernels_first_token_drift"])
        else:
            return False
    return bool(reference_drifts) and max(kernel_drifts) <= 2 * max(reference_drifts) + 0.01


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--seed", type=int, default=0,
                        help="draw other random checkpoints and prompts (0: those of the recorded results)")
    parser.add_argument("--smoke", action="store_true",
                        help="widths / 8, prompts / 10: a quick run of the script (e.g. on a CPU), not a check")
    parser.add_argument("--smoke-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="with --smoke: the dtype of the bfloat16 runs")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="the kernels' run's KV cache (the references keep theirs in the compute dtype)")
    parser.add_argument("--reference-run", nargs=2, metavar=("DTYPE", "OUT"), help=argparse.SUPPRESS)  # a child
    args = parser.parse_args()
    if args.smoke_dtype != "bfloat16" and not args.smoke:
        parser.error("--smoke-dtype needs --smoke")
    if args.smoke:
        use_smoke_sizes()
    low = args.smoke_dtype  # the "bfloat16" runs' dtype
    if args.reference_run:  # the checkpoints lie beside the output file
        dtype, out_file = args.reference_run
        force_reference(KERNEL_FAMILIES)
        folder = os.path.dirname(out_file)
        with open(out_file, "w") as out:
            json.dump({f: generate(os.path.join(folder, f), dtype, args.seed) for f in args.families}, out)
        return
    smoke = ["--smoke", "--smoke-dtype", args.smoke_dtype] if args.smoke else []
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            write_checkpoint(os.path.join(tmp, family), family, args.seed, args.smoke)
        runs = {}
        for name, dtype in (("bfloat16", low), ("float32", "float32")):
            out_file = os.path.join(tmp, f"reference_{name}.json")
            subprocess.run([sys.executable, __file__, "--reference-run", dtype, out_file, "--seed", str(args.seed),
                            *smoke, "--families", *args.families], check=True)
            with open(out_file) as f:
                runs[f"reference_{name}"] = json.load(f)
        for family in args.families:
            family_runs = {"kernels": generate(os.path.join(tmp, family), low, args.seed, args.kv_cache_dtype),
                           **{name: run[family] for name, run in runs.items()}}
            rows = compare(family_runs)
            results[family] = {"requests": rows, "ok": family_passes(rows)}
            print(family, results[family], flush=True)
    ok = all(result["ok"] for result in results.values())
    print("model check ok:", ok)
    smoke_fields = {"smoke": True, "smoke_dtype": args.smoke_dtype} if args.smoke else {}
    fp8 = args.kv_cache_dtype == "fp8"
    name = "model_check_smoke" if args.smoke else "model_check"
    write_json(f"{name}_kv_fp8.json" if fp8 else f"{name}.json",
               {"environment": environment(), "seed": args.seed, "max_tokens": MAX_TOKENS, **smoke_fields,
                "kv_cache_dtype": args.kv_cache_dtype, "families": results, "ok": ok})


if __name__ == "__main__":
    main()
