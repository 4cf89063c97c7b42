"""Ahead-of-time compilation: bucket keys, the warm-up grid, and the no-compile-after-warm-up guard.

Every device call the engine makes is one of two programs (a mixed prefill/decode step, a multi-step
decode loop) at one bucket of shapes. ``CompileKey`` names that bucket. The engine compiles the
whole grid at start-up (or loads it from an export, ``jaxinfer.engine.export``) and afterwards only
calls the compiled executables; with ``strict`` on, a missing key raises, and so does any tracing or
compilation (``jax.no_tracing`` plus a listener on XLA's compile events).

The grid's axes, and why each is as fine as it is (``scripts/grid_costs.py`` measures them): mixed
steps bucket the token count in powers of two (a prefill's cost grows with its tokens); decode loops
bucket the sequence count in powers of two (a decode step of 8 sequences costs ~10% more than one of
1 on the GPU, of 32 ~35% more) and the block-table width in powers of ``page_bucket_growth``
(default 4): the GPU decode kernel stops at each sequence's length, so a wider table costs little,
while each key costs seconds of compilation.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax

from jaxinfer.engine.config import EngineConfig, geometric_buckets
from jaxinfer.errors import CompilationAfterWarmupError

MIXED = "mixed"
DECODE = "decode"


@dataclasses.dataclass(frozen=True, order=True)
class CompileKey:
    kind: str  # MIXED or DECODE
    num_tokens: int
    num_seqs: int
    pages_per_seq: int

    def __str__(self) -> str:
        return f"{self.kind}(tokens={self.num_tokens}, seqs={self.num_seqs}, pages={self.pages_per_seq})"


@dataclasses.dataclass(frozen=True)
class BucketGrid:
    token_buckets: tuple[int, ...]  # mixed steps: padded token count
    seq_buckets: tuple[int, ...]  # decode loops: padded sequence count
    page_buckets: tuple[int, ...]  # decode loops: padded block-table width

    @classmethod
    def from_config(cls, config: EngineConfig) -> "BucketGrid":
        return cls(
            token_buckets=geometric_buckets(min(config.min_token_bucket, config.max_num_batched_tokens),
                                            config.max_num_batched_tokens),
            seq_buckets=geometric_buckets(1, config.max_num_seqs),
            page_buckets=geometric_buckets(1, config.max_pages_per_seq, config.page_bucket_growth),
        )

    def keys(self, config: EngineConfig) -> list[CompileKey]:
        # Mixed steps pad sequences and block tables to the maximum: their cost is dominated by the
        # token count, and one axis keeps the grid small. Decode loops bucket both, since attention
        # over the block table is what a decode step spends its time on.
        mixed = [CompileKey(MIXED, t, config.max_num_seqs, config.max_pages_per_seq) for t in self.token_buckets]
        decode = [CompileKey(DECODE, s, s, p) for s in self.seq_buckets for p in self.page_buckets]
        return mixed + decode


_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # also reported for a persistent-cache read
_CACHE_READ_EVENT = "/jax/compilation_cache/cache_retrieval_time_sec"
_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"


class CompileCount:
    """What happened inside a ``CompileGuard.counting()`` block, so far. Calling it gives the
    programs XLA compiled (persistent-cache reads not counted)."""

    def __init__(self, guard: "CompileGuard"):
        self._guard = guard
        self._start = (guard.compiles_while_armed, guard.cache_reads_while_armed, guard.traces_while_armed)

    def __call__(self) -> int:
        return self.compiled_and_read - self.cache_reads

    @property
    def compiled_and_read(self) -> int:
        """Programs handed to XLA: compiled, or read from the persistent compilation cache."""
        return self._guard.compiles_while_armed - self._start[0]

    @property
    def cache_reads(self) -> int:
        return self._guard.cache_reads_while_armed - self._start[1]

    @property
    def traces(self) -> int:
        """Python functions traced to jaxprs (``jit``, ``eval_shape``, ...)."""
        return self._guard.traces_while_armed - self._start[2]


class CompileGuard:
    """Counts XLA compilations (and traces) while armed; ``serving()`` raises if any happened inside it."""

    _installed: "CompileGuard | None" = None

    def __init__(self):
        self.compiles_while_armed = 0  # XLA compilations, persistent-cache reads included
        self.cache_reads_while_armed = 0
        self.traces_while_armed = 0
        self._armed = 0

    @classmethod
    def get(cls) -> "CompileGuard":
        if cls._installed is None:
            cls._installed = cls()
            jax.monitoring.register_event_duration_secs_listener(cls._installed._on_event)
        return cls._installed

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if not self._armed:
            return
        if event == _COMPILE_EVENT:
            self.compiles_while_armed += 1
        elif event == _CACHE_READ_EVENT:
            self.cache_reads_while_armed += 1
        elif event == _TRACE_EVENT:
            self.traces_while_armed += 1

    @contextlib.contextmanager
    def counting(self):
        """Yields a ``CompileCount``: called, how many programs XLA compiled inside the block (not
        counting those read from the persistent compilation cache); its attributes, the cache reads
        and the traces."""
        count = CompileCount(self)
        self._armed += 1
        try:
            yield count
        finally:
            self._armed -= 1

    @contextlib.contextmanager
    def serving(self):
        """Raises if anything is traced or handed to XLA inside the block (a cache read included)."""
        start = self.compiles_while_armed
        self._armed += 1
        try:
            with jax.no_tracing(True):
                yield
        except RuntimeError as e:
            if "no_tracing" in str(e):
                raise CompilationAfterWarmupError(f"strict mode: a function was traced after warm-up: {e}") from e
            raise
        finally:
            self._armed -= 1
        if self.compiles_while_armed != start:
            raise CompilationAfterWarmupError(
                f"strict mode: {self.compiles_while_armed - start} XLA compilation(s) happened after warm-up"
            )


def enable_compilation_cache(directory: str) -> None:
    """Persist compiled executables so the next start-up reads them instead of compiling.

    JAX opens its cache once per process; pointing it at another directory resets it first.
    """
    from jax.experimental.compilation_cache import compilation_cache

    if jax.config.jax_compilation_cache_dir != directory:
        compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
