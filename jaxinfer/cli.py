"""The ``jaxinfer`` command line: ``generate``, ``info`` and ``make-tiny``."""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from jaxinfer.errors import JaxInferError


def _engine_options(args) -> dict:
    from jaxinfer.tiny import jaxinfer_home

    cache_dir = None if args.no_compilation_cache else (
        args.compilation_cache_dir or os.path.join(jaxinfer_home(), "xla-cache"))
    options = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
               "page_size": args.page_size, "strict": args.strict, "compilation_cache_dir": cache_dir}
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    return options


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), bfloat16, float16 or float32")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt+output (default: the model's, <= 8192)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--strict", action="store_true", help="fail if anything compiles after the warm-up")
    p.add_argument("--compilation-cache-dir", default=None,
                   help="persistent compilation cache (default: xla-cache under $JAXINFER_HOME or ~/.cache/jaxinfer)")
    p.add_argument("--no-compilation-cache", action="store_true", help="compile everything afresh")


def _model_path(args) -> str:
    if args.model:
        return args.model
    from jaxinfer.tiny import ensure_default_checkpoint

    path = ensure_default_checkpoint()
    print(f"no --model given: using the built-in tiny random checkpoint at {path}", file=sys.stderr)
    return path


def cmd_generate(args) -> int:
    from jaxinfer import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            seed=args.seed, max_tokens=args.max_tokens, stop=args.stop or None,
                            ignore_eos=args.ignore_eos)
    llm = LLM(_model_path(args), args.dtype, **_engine_options(args))
    if args.prompt_ids:
        ids = [[int(t) for t in p.split(",")] for p in args.prompt_ids]
        outputs = llm.generate(sampling_params=params, prompt_token_ids=ids)
    elif args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outputs = llm.generate(args.prompt, params)
    for out in outputs:
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason}))
        else:
            print(out.text if llm.tokenizer is not None else out.token_ids)
    return 0


def cmd_info(args) -> int:
    from jaxinfer.cache.layout import KVCacheLayout
    from jaxinfer.config import ModelConfig
    from jaxinfer.engine.aot import BucketGrid
    from jaxinfer.engine.config import EngineConfig
    from jaxinfer.loader import resolve_dtype
    from jaxinfer.registry import ModelRegistry
    from jaxinfer.tokenizer import has_tokenizer
    from jaxinfer.weights import SafetensorsCheckpoint

    path = _model_path(args)
    config = ModelConfig.from_pretrained(path)
    model_cls = ModelRegistry.resolve(config.architecture)
    model_cls.validate_config(config)
    dtype = resolve_dtype(args.dtype, config)
    checkpoint = SafetensorsCheckpoint(path)
    num_params = sum(int(np.prod(checkpoint.shape(n))) for n in checkpoint.names())
    engine = EngineConfig(**_engine_options(args))
    engine.max_model_len = engine.max_model_len or min(config.max_position_embeddings, 8192)
    specs = model_cls.kv_cache_specs(config)
    page_bytes = KVCacheLayout.bytes_per_page_for(specs, engine.page_size, dtype)
    grid = BucketGrid.from_config(engine)
    keys = grid.keys(engine)
    kinds = sorted({s.kind for s in specs})
    print(f"path:            {path}")
    print(f"architecture:    {config.architecture} ({model_cls.__module__}:{model_cls.__name__})")
    print(f"parameters:      {num_params:,} ({num_params * np.dtype(dtype).itemsize / 2**20:.1f} MiB as {np.dtype(dtype).name})")
    print(f"checkpoint dtype {config.dtype or 'unspecified'}; serving dtype {np.dtype(dtype).name}")
    print(f"layers:          {config.num_hidden_layers} ({', '.join(kinds)}), {config.num_attention_heads} q / "
          f"{config.num_key_value_heads} kv heads of {config.head_dim}")
    print(f"tokenizer:       {'yes' if has_tokenizer(path) else 'none (token-id prompts only)'}")
    print(f"KV cache:        {page_bytes / engine.page_size / 1024:.1f} KiB per token, {page_bytes / 2**20:.2f} MiB per "
          f"page of {engine.page_size}; one full sequence of {engine.max_model_len} tokens needs "
          f"{engine.max_pages_per_seq * page_bytes / 2**20:.1f} MiB")
    print(f"compile buckets: {len(keys)} (tokens {list(grid.token_buckets)}; seqs {list(grid.seq_buckets)}; "
          f"pages {list(grid.page_buckets)})")
    if args.verbose:
        for key in keys:
            print(f"  {key}")
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
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON object per output")
    _add_engine_arguments(g)
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="describe a checkpoint and the engine it would get")
    i.add_argument("model", nargs="?", help="HF checkpoint folder (default: the built-in tiny one)")
    i.add_argument("-v", "--verbose", action="store_true", help="list every compile key")
    _add_engine_arguments(i)
    i.set_defaults(func=cmd_info)

    t = sub.add_parser("make-tiny", help="write a tiny random checkpoint in HF format")
    t.add_argument("path")
    t.add_argument("--family", default="llama", help="llama, mistral, qwen2, qwen3, qwen3_moe or minimax_m2")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_make_tiny)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate" and not (args.prompt or args.prompt_ids):
        args.prompt = ["Hello"]
    try:
        return args.func(args)
    except JaxInferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
