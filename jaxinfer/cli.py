"""The ``jaxinfer`` command line: ``generate``, ``export``, ``info`` and ``make-tiny``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np

from jaxinfer.errors import JaxInferError
from jaxinfer.tiny import TINY_FAMILIES


def _engine_options(args) -> dict:
    """The engine options given on the command line (the others keep EngineConfig's defaults, or,
    with --executables, the export's)."""
    options = {"max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
               "max_num_batched_tokens": args.max_num_batched_tokens, "page_size": args.page_size,
               "page_bucket_growth": args.page_bucket_growth, "compilation_cache_dir": args.compilation_cache_dir,
               "tensor_parallel_size": args.tensor_parallel_size, "data_parallel_size": args.data_parallel_size,
               "kv_cache_dtype": args.kv_cache_dtype}
    options = {name: value for name, value in options.items() if value is not None}
    for flag, option, value in (("strict", "strict", True), ("no_compilation_cache", "compilation_cache", False),
                                ("allow_long_max_model_len", "allow_long_max_model_len", True),
                                ("enable_expert_parallel", "enable_expert_parallel", True)):
        if getattr(args, flag):
            options[option] = value
    return options


# C0 and C1 control characters other than newline and tab: a terminal would act on them (escape
# sequences can move the cursor, rewrite the title, ...), so generated text shows them escaped.
_CONTROL = dict.fromkeys([*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0)])


def printable(text: str) -> str:
    """``text`` with control characters (except newline and tab) as ``\\xNN`` escapes."""
    if not any(ord(ch) in _CONTROL for ch in text):
        return text
    return "".join(f"\\x{ord(ch):02x}" if ord(ch) in _CONTROL else ch for ch in text)


def _quantization(args) -> str | None:
    return None if args.quantization == "none" else args.quantization


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), bfloat16, float16 or float32")
    p.add_argument("--quantization", default="auto", choices=["auto", "none"],
                   help="auto: an fp8 checkpoint's weights stay fp8 on the device; none: dequantized to --dtype")
    p.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8", "fp8_e4m3"],
                   help="auto (default): the KV cache in --dtype; fp8: float8_e4m3fn with a per-layer scale "
                        "(the checkpoint's k_scale / v_scale, else 1.0)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt+output (default: the model's, <= 8192)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step (default 8)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per prefill step (default 512)")
    p.add_argument("--page-size", type=int, default=None, help="tokens per KV page (default 16)")
    p.add_argument("--page-bucket-growth", type=int, default=None,
                   help="ratio between the decode block-table buckets (default 4; 2 is the finest grid)")
    p.add_argument("--strict", action="store_true", help="fail if anything compiles after the warm-up")
    p.add_argument("--compilation-cache-dir", default=None,
                   help="persistent compilation cache (default: xla-cache under $JAXINFER_HOME or ~/.cache/jaxinfer)")
    p.add_argument("--no-compilation-cache", action="store_true", help="compile everything afresh")
    p.add_argument("--allow-long-max-model-len", action="store_true",
                   help="allow --max-model-len beyond the model's max_position_embeddings")
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="devices each layer is split over: heads, MLP width, vocabulary (default 1)")
    p.add_argument("--data-parallel-size", type=int, default=None,
                   help="ranks of --tensor-parallel-size devices, each serving its own sequences (default 1)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="split MoE experts whole over all the devices instead of by width")


def _model_path(args) -> str:
    if args.model:
        return args.model
    if getattr(args, "executables", None):
        from jaxinfer.engine.manifest import Manifest

        path = Manifest.read(args.executables).checkpoint["path"]
        print(f"no --model given: using the checkpoint the export was built from, {path}", file=sys.stderr)
        return path
    from jaxinfer.tiny import ensure_default_checkpoint

    path = ensure_default_checkpoint()
    print(f"no --model given: using the built-in tiny random checkpoint at {path}", file=sys.stderr)
    return path


def cmd_generate(args) -> int:
    from jaxinfer import LLM, SamplingParams

    # Sampling flags override the checkpoint's generation_config.json defaults; checked before loading.
    given = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p}
    given = {k: v for k, v in given.items() if v is not None}
    given.update(seed=args.seed, max_tokens=args.max_tokens, stop=args.stop or None, ignore_eos=args.ignore_eos)
    SamplingParams(**given)
    prompt_ids = [_parse_ids(p) for p in args.prompt_ids]
    options = _engine_options(args)
    if args.executables:
        # One command's prompts need a few of the export's programs: load each on first use (a
        # strict engine loads them all at start-up).
        options.update(executables=args.executables, warmup=bool(args.strict))
    llm = LLM(_model_path(args), args.dtype, quantization=_quantization(args),
              coordinator_address=args.coordinator_address, num_processes=args.num_processes,
              process_id=args.process_id, **options)
    if not llm.is_leader:  # another host's process: run what process 0 schedules
        llm.follow()
        return 0
    params = dataclasses.replace(llm.get_default_sampling_params(), **given)
    if prompt_ids:
        outputs = llm.generate(sampling_params=params, prompt_token_ids=prompt_ids)
    elif args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outputs = llm.generate(args.prompt, params)
    llm.shutdown()
    if args.verbose:
        print("\n".join(llm.startup_report.lines()), file=sys.stderr)
    failed = False
    for number, out in enumerate(outputs, 1):
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason, "error": out.error}))
        else:
            text = out.text if llm.tokenizer is not None else str(out.token_ids)
            print(printable(text) if sys.stdout.isatty() else text)
        if out.error is not None:  # the request ended early (e.g. logits that were not finite): exit 1
            print(f"error: prompt {number}: {out.error}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


def _parse_ids(text: str) -> list[int]:
    from jaxinfer.errors import InvalidRequestError

    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise InvalidRequestError(f"--prompt-ids takes comma-separated integers, got {text!r}") from None


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 1024:.1f} KiB" if num_bytes < 2**20 else f"{num_bytes / 2**20:.2f} MiB"


def cmd_info(args) -> int:
    from jaxinfer.cache.layout import CacheLayout
    from jaxinfer.engine import memory
    from jaxinfer.engine.aot import BucketGrid
    from jaxinfer.engine.config import EngineConfig
    from jaxinfer.loader import open_checkpoint, resolve_dtype
    from jaxinfer.quantization import mxfp4_tensors, parameter_count, stored_bytes
    from jaxinfer.sharding.for_model import abstract_plan
    from jaxinfer.sharding.plan import bytes_per_device
    from jaxinfer.tokenizer import has_tokenizer
    from jaxinfer.weights import declared_params

    path = _model_path(args)
    config, model_cls, checkpoint = open_checkpoint(path)
    dtype = resolve_dtype(args.dtype, config)
    num_params = parameter_count(checkpoint)
    weight_bytes = num_params * np.dtype(dtype).itemsize
    engine = EngineConfig(**_engine_options(args)).for_model(config)
    specs = model_cls.cache_specs(config)
    layout = CacheLayout(specs, engine.page_size, 1, dtype, num_slots=1, kv_dtype=engine.kv_dtype)
    grid = BucketGrid.from_config(engine)
    keys = grid.keys(engine)
    print(f"path:            {path}")
    print(f"architecture:    {config.architecture} ({model_cls.__module__}:{model_cls.__name__})")
    print(f"parameters:      {num_params:,} ({weight_bytes / 2**20:.1f} MiB as {np.dtype(dtype).name})")
    print(f"checkpoint dtype {config.dtype or 'unspecified'}; serving dtype {np.dtype(dtype).name}")
    if config.quantization is not None:
        kept = ("kept in fp8 on the device where a layer takes it (--quantization none: dequantized to "
                f"{np.dtype(dtype).name})" if _quantization(args) else f"dequantized to {np.dtype(dtype).name} on load")
        print(f"quantization:    {config.quantization.describe()}; {checkpoint.stored_bytes() / 2**20:.1f} MiB as "
              f"stored; {kept}")
    elif mxfp4_tensors(checkpoint):
        kept = ("experts kept in 4 bits on the device (--quantization none: dequantized to "
                f"{np.dtype(dtype).name})" if _quantization(args) else f"dequantized to {np.dtype(dtype).name} on load")
        print(f"quantization:    mxfp4 experts (e2m1 values, one e8m0 scale per 32); "
              f"{stored_bytes(checkpoint) / 2**20:.1f} MiB as stored; {kept}")
    print(f"layers:          {config.num_hidden_layers}, {config.num_attention_heads} q / "
          f"{config.num_key_value_heads} kv heads of {config.head_dim}")
    print(f"tokenizer:       {'yes' if has_tokenizer(path) else 'none (token-id prompts only)'}")
    if engine.tensor_parallel_size * engine.data_parallel_size > 1:
        shapes, axes = declared_params(model_cls, config, dtype)
        plan = abstract_plan(model_cls, config, shapes, axes, **engine.parallelism())
        per_device = sum(bytes_per_device(s.shape, dtype, axes[path], plan) for path, s in shapes.items())
        # Loading reads one tensor at a time, a slice per device: the most host memory it holds at once.
        largest = plan.size * max(bytes_per_device(s.shape, s.dtype, axes[path], plan) for path, s in shapes.items())
        print(f"per device:      {per_device / 2**20:.1f} MiB of weights on each of {plan.size} devices "
              f"(tensor_parallel_size={plan.tensor_parallel}, data_parallel_size={plan.data_parallel}, "
              f"KV heads on {plan.mesh.shape['kv_replica']} "
              f"device(s) each{', experts split whole' if plan.expert_parallel else ''}); loading holds at most "
              f"{largest / 2**20:.1f} MiB of host memory at once (one tensor's slices)")
    kv_dtype = np.dtype(engine.kv_dtype or dtype).name
    scaled = ", a float32 scale per layer and array" if engine.kv_dtype is not None else ""
    print(f"cache:           paged arrays in {kv_dtype}{scaled}; state slots in {np.dtype(dtype).name}; "
          "per kind, over all layers:")
    for kind, (per_token, per_sequence) in sorted(layout.bytes_by_kind().items()):
        layers = sum(1 for layer in specs if any(spec.kind == kind for spec in layer))
        cost = f"{per_token / 1024:.1f} KiB per token" if per_token else f"{_size(per_sequence)} per sequence"
        print(f"  {kind:<12} {layers:>3} layers, {cost}")
    if CacheLayout.needs_slots(specs):
        print("                 per-sequence state cannot resume from a shared prefix: prefix caching is off "
              "for this model")
    sequence_bytes = layout.bytes_per_page * engine.max_pages_per_seq + layout.bytes_per_slot
    print(f"                 one sequence of {engine.max_model_len} tokens needs {sequence_bytes / 2**20:.1f} MiB")
    available = memory.available_bytes()
    if available is not None and sequence_bytes:
        budget = (available - weight_bytes) * engine.kv_cache_memory_fraction
        print(f"                 {max(0, int(budget // sequence_bytes))} of them fit in this device's free memory "
              f"after the weights (kv_cache_memory_fraction={engine.kv_cache_memory_fraction})")
    print(f"compile buckets: {len(keys)} (tokens {list(grid.token_buckets)}; seqs {list(grid.seq_buckets)}; "
          f"pages {list(grid.page_buckets)})")
    if args.verbose:
        for key in keys:
            print(f"  {key}")
    return 0


def cmd_export(args) -> int:
    from jaxinfer import LLM

    # The export compiles every program itself (afresh): no warm-up first.
    llm = LLM(_model_path(args), args.dtype, quantization=_quantization(args), warmup=False, **_engine_options(args))
    manifest = llm.export(args.out, portable=args.portable)
    forms = sorted({p.form for p in manifest.programs})
    print(f"wrote {len(manifest.programs)} programs ({', '.join(forms)}) and manifest.json to {args.out}")
    if args.portable:
        kept = [p.name for p in manifest.programs if p.not_portable]
        if kept:
            print(f"not export-stable, kept as executables: {', '.join(kept)}", file=sys.stderr)
    return 0


def cmd_make_tiny(args) -> int:
    from jaxinfer.tiny import write_tiny_checkpoint

    print(write_tiny_checkpoint(args.path, args.family, seed=args.seed))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from prompts")
    g.add_argument("--model", help="HF checkpoint folder (default: a built-in tiny random Llama)")
    g.add_argument("--prompt", action="append", default=[], help="a text prompt (repeat for a batch)")
    g.add_argument("--prompt-ids", action="append", default=[], help="a token-id prompt, comma separated")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=None,
                   help="0 is greedy (default: the checkpoint's generation_config.json, else 1.0)")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON object per output")
    g.add_argument("--executables", default=None, metavar="EXPORT_DIR",
                   help="serve the programs of an export (`jaxinfer export`) instead of compiling; it fixes the "
                        "engine options (default --model: the checkpoint it was built from). Trust it like code")
    g.add_argument("-v", "--verbose", action="store_true", help="print the start-up phases' times")
    g.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="several hosts: process 0's address (run the same command on every host)")
    g.add_argument("--num-processes", type=int, default=None, help="several hosts: how many processes")
    g.add_argument("--process-id", type=int, default=None, help="several hosts: this process's id (0 prints)")
    _add_engine_arguments(g)
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("export", help="compile the bucket grid and write the executables and a manifest")
    e.add_argument("--model", help="HF checkpoint folder (default: the built-in tiny one)")
    e.add_argument("--out", required=True, metavar="EXPORT_DIR", help="the export directory (new, or an export)")
    e.add_argument("--portable", action="store_true",
                   help="StableHLO (jax.export) for every program whose custom calls are export-stable: loads on "
                        "other jax versions and device kinds of the platform, compiling at load")
    _add_engine_arguments(e)
    e.set_defaults(func=cmd_export)

    i = sub.add_parser("info", help="describe a checkpoint and the engine it would get")
    i.add_argument("model", nargs="?", help="HF checkpoint folder (default: the built-in tiny one)")
    i.add_argument("-v", "--verbose", action="store_true", help="list every compile key")
    _add_engine_arguments(i)
    i.set_defaults(func=cmd_info)

    t = sub.add_parser("make-tiny", help="write a tiny random checkpoint in HF format")
    t.add_argument("path")
    t.add_argument("--family", default="llama", help=f"one of {', '.join(TINY_FAMILIES)}")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_make_tiny)
    return parser


def main(argv=None) -> int:
    """Run a command; a user error (bad input, a missing or unreadable file) prints ``error: ...`` and
    exits 2, an interrupt exits 130, both without a traceback. ``generate`` exits 1 when a request
    ended with an error (printed as ``error: prompt N: ...``; its output is printed too)."""
    args = build_parser().parse_args(argv)
    if args.command == "generate" and not (args.prompt or args.prompt_ids):
        args.prompt = ["Hello"]
    try:
        return args.func(args)
    except (JaxInferError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
