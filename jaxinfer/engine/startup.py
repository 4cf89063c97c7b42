"""Where start-up time goes: seconds per phase, and where the programs came from.

``LLM.startup_report`` holds one ``StartupReport``; ``jaxinfer generate -v`` prints it. The phases,
in order: the Python imports (process start until ``LLM(...)`` is called), config + weights (config,
tokenizer, checkpoint headers, weights onto the devices), cache allocation, lowering (tracing the
grid's programs), compiling (XLA compiles, persistent-cache reads, or loading an export's programs),
and the first token (the first ``generate`` call until its first token exists).
"""

from __future__ import annotations

import dataclasses
import os
import time


def process_age() -> float | None:
    """Seconds since this process started (Linux ``/proc``), or None where unknown."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime"))
        started = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return max(0.0, time.time() - started)


@dataclasses.dataclass
class StartupReport:
    imports_s: float | None = None  # process start -> LLM(...); None where the process start is unknown
    config_and_weights_s: float = 0.0
    cache_allocation_s: float = 0.0
    lowering_s: float = 0.0
    compiling_s: float = 0.0  # compiling the grid, reading it from the persistent cache, or loading an export
    first_token_s: float | None = None  # the first generate() call until its first token; None before it
    to_first_token_s: float | None = None  # process start -> the first token
    programs_compiled: int = 0  # XLA programs compiled at start-up (the grid, the cache allocation, checks)
    programs_from_cache: int = 0  # ... read from the persistent compilation cache instead
    programs_from_export: int = 0  # ... loaded from an export (executables, or StableHLO then compiled)
    source: str = "compiled"  # "compiled", or "export" (LLM(..., executables=DIR))

    def lines(self) -> list[str]:
        def seconds(value):
            return "-" if value is None else f"{value:7.2f} s"

        return [
            f"start-up ({self.source}):",
            f"  imports             {seconds(self.imports_s)}",
            f"  config + weights    {seconds(self.config_and_weights_s)}",
            f"  cache allocation    {seconds(self.cache_allocation_s)}",
            f"  lowering            {seconds(self.lowering_s)}",
            f"  compiling / loading {seconds(self.compiling_s)}   ({self.programs_compiled} compiled, "
            f"{self.programs_from_cache} from the compilation cache, {self.programs_from_export} from the export)",
            f"  first token         {seconds(self.first_token_s)}",
            f"  process start -> first token {seconds(self.to_first_token_s)}",
        ]
