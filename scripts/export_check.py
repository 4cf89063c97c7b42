"""Exported serving programs on this machine's devices: each family's tiny checkpoint (at head_dim 128
on a GPU, so that its kernels take the calls) is served live, exported, then served from the export
in a fresh process under strict mode; the fresh process must compile and trace nothing and give the
live engine's greedy tokens. The kernels each program was built with come from the manifest.

    PYTHONPATH=. python3 scripts/export_check.py                      # writes export_check.json
    PYTHONPATH=. python3 scripts/export_check.py --families llama qwen3_next --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

# Two processes share the GPU (this one and the fresh one that serves the export): neither may take
# three quarters of its memory up front, as JAX does by default.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import environment, write_json  # noqa: E402

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the fresh process imports from here
PROMPTS = [[5, 17, 42, 99, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]]
OPTIONS = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, page_size=16, show_progress=False)
GREEDY = dict(temperature=0.0, max_tokens=16, ignore_eos=True)
# Widths at which the GPU kernels serve the tiny models (head_dim 128).
GPU_WIDTHS = {
    "llama": dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128),
    "qwen3_moe": dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128),
    "qwen3_next": dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                       linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128,
                       linear_value_head_dim=128),
    "deepseek_v3": {},
}

_SERVE = r"""
import collections, json, sys
import jax
events = collections.Counter()
jax.monitoring.register_event_duration_secs_listener(lambda event, seconds, **kw: events.update([event]))
from jaxinfer import LLM, SamplingParams
path, export, prompts, greedy = json.loads(sys.argv[1])
llm = LLM(path, executables=export, strict=True, show_progress=False)
outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(**greedy))
print(json.dumps({"tokens": [o.token_ids for o in outs], "compiles": events["/jax/core/compile/backend_compile_duration"],
                  "traces": events["/jax/core/compile/jaxpr_trace_duration"]}))
"""


def check(family: str, dtype: str, root: str) -> dict:
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.tiny import write_tiny_checkpoint

    widths = GPU_WIDTHS.get(family, {}) if jax.default_backend() == "gpu" else {}
    path = write_tiny_checkpoint(os.path.join(root, family), family, **widths)
    llm = LLM(path, dtype=dtype, warmup=False, **OPTIONS)
    export = os.path.join(root, f"{family}-export")
    manifest = llm.export(export)
    live = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(**GREEDY))]
    run = subprocess.run([sys.executable, "-c", _SERVE, json.dumps([path, export, PROMPTS, GREEDY])],
                         capture_output=True, text=True, cwd=REPOSITORY)
    result = {"forms": sorted({p.form for p in manifest.programs}),
              "kernels": sorted({f"{op}:{name}" for p in manifest.grid_programs for op, names in p.kernels.items()
                                 for name in names})}
    if run.returncode != 0:
        return {**result, "ok": False, "returncode": run.returncode, "stderr": run.stderr[-3000:]}
    served = json.loads(run.stdout.strip().splitlines()[-1])
    same = served["tokens"] == live
    return {**result, "ok": same and served["compiles"] == 0 and served["traces"] == 0, "same_tokens": same,
            "compiles": served["compiles"], "traces": served["traces"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(GPU_WIDTHS))
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for family in args.families:
            results[family] = check(family, args.dtype, root)
            print(family, json.dumps(results[family])[:400], flush=True)
    print("wrote", write_json("export_check.json", {"environment": environment(), "dtype": args.dtype,
                                                    "families": results}))
    if not all(r["ok"] for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
