"""Start-up times of ``jaxinfer generate``: cold (empty compilation cache), warm (from the persistent
compilation cache) and from an export (each program loaded on first use, and with ``--strict``
all loaded at start-up), each in a fresh process, as a table.

    PYTHONPATH=. python3 scripts/startup_times.py [--model DIR] [--repeats 3] [--starts cold warm export]
        [--json OUT] [-- ENGINE FLAGS...]

Defaults: the CLI's built-in tiny checkpoint and default engine options (the README's first
command). Engine flags after ``--`` (e.g. ``--page-bucket-growth 2``) go to every command. The
checkpoint, the caches and the export live in a temporary folder. Per start it prints the wall time
of the whole command, process start to the first token, and the engine's own phases
(``LLM.startup_report``, from ``jaxinfer generate -v``); warm and export starts are the fastest of
``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

_PHASE = re.compile(r"^\s+(imports|config \+ weights|cache allocation|lowering|compiling / loading|first token|"
                    r"process start -> first token)\s+([\d.]+|-)")
_COUNTS = re.compile(r"\((\d+) compiled, (\d+) from the compilation cache, (\d+) from the export\)")


def _run(argv: list[str], env: dict) -> dict:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "jaxinfer.cli", *argv], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"jaxinfer {' '.join(argv)} failed:\n{result.stderr[-3000:]}")
    row = {"wall_s": round(wall, 2)}
    for line in result.stderr.splitlines():
        match = _PHASE.match(line)
        if match:
            row[match.group(1)] = None if match.group(2) == "-" else float(match.group(2))
        counts = _COUNTS.search(line)
        if counts:
            row["compiled"], row["from_cache"], row["from_export"] = map(int, counts.groups())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF checkpoint folder (default: the built-in tiny one)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", default="Hello")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--starts", nargs="+", default=["cold", "warm", "export"], choices=["cold", "warm", "export"],
                        help="which starts to time (warm and export first run the cold start or the export)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("engine_flags", nargs=argparse.REMAINDER, help="-- then flags for every command")
    args = parser.parse_args()
    flags = [f for f in args.engine_flags if f != "--"]
    with tempfile.TemporaryDirectory(prefix="jaxinfer-startup-") as tmp:
        env = {**os.environ, "JAXINFER_HOME": os.path.join(tmp, "home")}
        model = ["--model", args.model] if args.model else []
        if not args.model:  # write the built-in checkpoint once, outside the timed runs
            subprocess.run([sys.executable, "-c", "from jaxinfer.tiny import ensure_default_checkpoint as e; e()"],
                           check=True, env=env)
        cache = ["--compilation-cache-dir", os.path.join(tmp, "xla-cache")]
        generate = ["generate", *model, "--prompt", args.prompt, "--max-tokens", str(args.max_tokens), "-v", *flags]
        rows, export_s = {}, None

        def fastest(argv):
            return min((_run(argv, env) for _ in range(args.repeats)), key=lambda r: r["wall_s"])

        if "cold" in args.starts or "warm" in args.starts:
            rows["cold"] = _run([*generate, *cache], env)
        if "warm" in args.starts:
            rows["warm"] = fastest([*generate, *cache])
        if "export" in args.starts:
            export_dir = os.path.join(tmp, "export")
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "jaxinfer.cli", "export", *model, "--out", export_dir,
                            "--no-compilation-cache", *flags], check=True, env=env, capture_output=True)
            export_s = time.perf_counter() - start
            rows["export"] = fastest([*generate, "--executables", export_dir])
            rows["export, strict (all loaded)"] = fastest([*generate, "--executables", export_dir, "--strict"])
    columns = ["wall_s", "process start -> first token", "imports", "config + weights", "cache allocation",
               "lowering", "compiling / loading", "first token", "compiled", "from_cache", "from_export"]
    print("| start | " + " | ".join(columns) + " |")
    print("|" + " --- |" * (len(columns) + 1))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join("-" if row.get(c) is None else str(row[c]) for c in columns) + " |")
    if export_s is not None:
        print(f"(`jaxinfer export` of the same grid: {export_s:.1f} s)")
    print(f"engine flags: {' '.join(flags) or 'none'}; {os.cpu_count()} CPUs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "export_s": None if export_s is None else round(export_s, 2), "flags": flags,
                       "cpus": os.cpu_count()}, f, indent=2)


if __name__ == "__main__":
    main()
