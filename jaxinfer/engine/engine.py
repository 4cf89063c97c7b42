"""The serving loop: requests in, scheduler decides, runner executes, outputs out.

A step that fails (an error in a kernel, the host code around it, or a ``KeyboardInterrupt``) leaves
the engine usable: its requests end with ``finish_reason="error"`` (``"abort"`` for an interrupt) and
give their pages back, the caches are re-made if the failed call had consumed them (every other
running request is then recomputed from its tokens), and the exception reaches the caller. A request
whose logits come out not finite (``NONFINITE_TOKEN``) ends alone, with ``"error"`` and a message;
the caches are then re-made, so nothing it wrote reaches a later request.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Iterable

import jax
import numpy as np

from jaxinfer.cache.allocator import PageAllocator, SlotAllocator
from jaxinfer.checks import is_integer
from jaxinfer.cache.layout import CacheLayout
from jaxinfer.engine import memory, multihost
from jaxinfer.engine.aot import DECODE, MIXED, BucketGrid, CompileGuard, CompileKey, enable_compilation_cache
from jaxinfer.engine.config import EngineConfig, bucket_for
from jaxinfer.engine.detokenizer import IncrementalDetokenizer
from jaxinfer.engine.request import Request, RequestStatus
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.sampling import NONFINITE_TOKEN, SamplingParams
from jaxinfer.engine.scheduler import DecodeBatch, MixedBatch, Scheduler, rank_rows
from jaxinfer.errors import ConfigError, InvalidRequestError
from jaxinfer.generation_config import GenerationDefaults
from jaxinfer.loader import LoadedModel, validate_token_ids


def _eos_token_ids(model: LoadedModel, generation: GenerationDefaults | None, tokenizer) -> tuple[int, ...]:
    """generation_config.json's eos_token_id, else config.json's, else the tokenizer's."""
    if generation is not None and generation.eos_token_ids is not None:
        return generation.eos_token_ids
    if model.config.eos_token_ids:
        return model.config.eos_token_ids
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return (tokenizer.eos_token_id,)
    return ()


def plan_num_pages(config: EngineConfig, page_bytes: int, available: int | None) -> int:
    """The page count: ``config.num_pages``, or enough for every sequence slot at full length (more
    would sit unused: no page outlives its request), either within ``kv_cache_memory_fraction`` of
    the ``available`` bytes. ``ConfigError`` when the pages cannot fit or cannot hold one sequence."""
    budget = None if available is None else int(available * config.kv_cache_memory_fraction)
    most_usable = config.max_num_seqs * config.max_pages_per_seq
    num_pages = config.num_pages
    if num_pages is None:
        num_pages = most_usable if budget is None or page_bytes == 0 else min(most_usable, budget // page_bytes)
    elif budget is not None and num_pages * page_bytes > budget:
        raise ConfigError(
            f"num_pages={num_pages} pages of {page_bytes / 2**20:.2f} MiB need {num_pages * page_bytes / 2**30:.2f} GiB; "
            f"{budget / 2**30:.2f} GiB are available for the KV cache (kv_cache_memory_fraction="
            f"{config.kv_cache_memory_fraction} of the free memory): lower num_pages"
        )
    if num_pages < config.max_pages_per_seq:
        where = "" if budget is None else f" ({budget / 2**30:.2f} GiB of memory available for the KV cache)"
        raise ConfigError(
            f"{num_pages} KV pages{where} cannot hold one sequence of max_model_len={config.max_model_len} "
            f"({config.max_pages_per_seq} pages of {config.page_size} tokens, {page_bytes / 2**20:.2f} MiB each); "
            "lower max_model_len or give the cache more memory"
        )
    return num_pages


def _left_after_slots(available: int | None, slot_bytes: int, config: EngineConfig) -> int | None:
    """The memory left for pages once every sequence's state slot is set aside; ``ConfigError`` when
    the slots alone do not fit."""
    if available is None or slot_bytes == 0:
        return available
    if slot_bytes > available * config.kv_cache_memory_fraction:
        raise ConfigError(
            f"the per-sequence state of max_num_seqs={config.max_num_seqs} sequences needs {slot_bytes / 2**30:.2f} GiB; "
            f"{available * config.kv_cache_memory_fraction / 2**30:.2f} GiB are available for the cache: lower max_num_seqs"
        )
    return available - slot_bytes


def plan_cache(config: EngineConfig, layer_specs, dtype, available: int | None) -> tuple[int, int]:
    """(num_pages, num_slots) of the cache for ``config`` within the ``available`` bytes (see
    ``plan_num_pages``); ``ConfigError`` when it cannot fit."""
    num_slots = config.max_num_seqs if CacheLayout.needs_slots(layer_specs) else 0
    page_bytes = CacheLayout.bytes_per_token_for(layer_specs, dtype, config.kv_dtype) * config.page_size
    slot_bytes = CacheLayout.bytes_per_sequence_for(layer_specs, dtype) * num_slots
    return plan_num_pages(config, page_bytes, _left_after_slots(available, slot_bytes, config)), num_slots


def _common_window(layer_specs) -> int | None:
    """The sliding window every paged layer reads within, or None if some paged layer reads more."""
    paged = [spec for specs in layer_specs for spec in specs if spec.paged]
    windows = {getattr(spec, "sliding_window", None) for spec in paged}
    return windows.pop() if len(windows) == 1 and None not in windows else None


class Engine:
    """Serves ``model``. ``generation_defaults``: the checkpoint's generation config, when the caller
    has read it already (else it is read from ``model.path``). ``programs``: an export's programs
    (``jaxinfer.engine.export.ProgramSet``) to serve instead of compiling the grid; ``config`` must
    then be the export's options (``LLM(..., executables=DIR)`` sees to it). With ``warmup`` they
    are all loaded at start-up, else each on its first use."""

    def __init__(self, model: LoadedModel, config: EngineConfig | None = None, *, tokenizer=None,
                 generation_defaults: GenerationDefaults | None = None, programs=None):
        config = (config or EngineConfig()).for_model(model.config)
        # The partitioning is the model's (a custom mesh may have set it).
        config = dataclasses.replace(config, tensor_parallel_size=model.plan.tensor_parallel,
                                     data_parallel_size=model.plan.data_parallel,
                                     enable_expert_parallel=model.plan.expert_parallel)
        if config.cache_dir():  # first, so every program of the engine is read from it or written to it
            enable_compilation_cache(config.cache_dir())
        self.model = model
        specs = model.model_cls.cache_specs(model.config)
        # Pages, slots and sequences are per data-parallel rank; the cache arrays hold every rank's.
        config.num_pages, num_slots = plan_cache(config, specs, model.dtype, memory.available_bytes())
        ranks = model.plan.data_parallel
        self.config = config
        self.layout = CacheLayout(specs, config.page_size, config.num_pages * ranks, model.dtype, num_slots * ranks,
                                  kv_dtype=config.kv_dtype, kv_scales=model.kv_scales)
        self.generation_defaults = generation_defaults or GenerationDefaults.read(model.path, model.config.vocab_size)
        self.eos_token_ids = _eos_token_ids(model, self.generation_defaults, tokenizer)
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(config, PageAllocator(config.num_pages, ranks),
                                   SlotAllocator(num_slots, ranks) if num_slots else None, window=_common_window(specs))
        self.runner = ModelRunner(model, config, self.layout)
        self.grid = BucketGrid.from_config(config)
        self._next_id = 0
        self._lock = threading.RLock()  # the scheduler's state: steps and aborts from other threads
        self._stepping = False
        self._pending_aborts: set[int] = set()
        self.first_token_at: float | None = None  # time.perf_counter() when the first token was generated
        # Seconds per start-up phase: compiling_s is compiling the grid, or loading it from an export.
        self.startup_seconds: dict[str, float] = {"lowering_s": 0.0, "compiling_s": 0.0, "cache_allocation_s": 0.0}
        self.warmup_seconds = None
        if programs is not None:
            from jaxinfer.engine.export import check_grid

            check_grid(programs.manifest, self.grid, config)
            start = time.perf_counter()
            programs.install(self.runner, eager=config.warmup)
            self.startup_seconds["compiling_s"] = time.perf_counter() - start
            self.runner.strict = config.strict
        elif config.warmup:
            start = time.perf_counter()
            self.runner.install_allocator(self.runner.compile_lowered(self.runner.lower_allocator()))
            self.startup_seconds["compiling_s"] += time.perf_counter() - start
        start = time.perf_counter()
        self.runner.allocate_caches()
        self.startup_seconds["cache_allocation_s"] = time.perf_counter() - start
        if programs is None and config.warmup:
            self.warmup()
        if jax.process_count() > 1 and multihost.is_leader():  # from here on, the followers make each call too
            self.runner.leader = multihost.Leader()

    def follow(self) -> int:
        """On a process other than 0 of several: make the device calls process 0 sends, until it
        stops (``jaxinfer.engine.multihost``); -> the calls made."""
        if jax.process_count() == 1 or multihost.is_leader():
            raise RuntimeError("follow() runs on the processes other than 0 of a multi-process engine")
        return multihost.follow(self.runner)

    def shutdown(self) -> None:
        """On process 0 of several: tell the other processes to stop following (idempotent)."""
        if self.runner.leader is not None:
            self.runner.leader.send(multihost.STOP)
            self.runner.leader = None

    # ---- start-up ------------------------------------------------------------------------------

    def warmup(self) -> None:
        """Compile every key of the bucket grid, with a progress bar.

        Tracing and lowering run one key at a time (Python); XLA compiles them in parallel threads.
        """
        keys = self.grid.keys(self.config)
        start = time.perf_counter()
        progress = None
        if self.config.show_progress:
            from tqdm.auto import tqdm

            progress = tqdm(total=2 * len(keys), desc="compiling", unit="step")
        lowered = []
        for key in keys:
            lowered.append(self.runner.lower(key))
            progress and progress.update()
        lowered_at = time.perf_counter()

        def compile_one(item):
            key, program = item
            executable = self.runner.compile_lowered(program)
            progress and progress.update()
            return key, executable

        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            for key, executable in pool.map(compile_one, zip(keys, lowered)):
                self.runner.add_executable(key, executable)
        if progress:
            progress.close()
        done = time.perf_counter()
        self.warmup_seconds = done - start
        self.startup_seconds["lowering_s"] += lowered_at - start
        self.startup_seconds["compiling_s"] += done - lowered_at
        self.runner.strict = self.config.strict

    # ---- requests ------------------------------------------------------------------------------

    def make_request(self, prompt_token_ids, params: SamplingParams, prompt: str | None = None) -> Request:
        """Validate everything about one request; nothing is queued here."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params = dataclasses.replace(params)  # a checked snapshot: later edits of the caller's object do not apply
        params.check_vocabulary(self.model.config.vocab_size)
        ids = validate_token_ids(prompt_token_ids, self.model.config.vocab_size)
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; max_model_len is {limit}, which leaves no room to generate "
                "(shorten the prompt or raise max_model_len)"
            )
        most = self.config.max_logprobs
        if params.logprobs is not None and (most is None or params.logprobs > most):
            raise InvalidRequestError(
                f"logprobs={params.logprobs} exceeds the engine's max_logprobs={most}"
            )
        stop_ids = tuple(dict.fromkeys((() if params.ignore_eos else self.eos_token_ids) + tuple(params.stop_token_ids or ())))
        if len(stop_ids) > self.config.max_stop_token_ids:
            raise InvalidRequestError(
                f"{len(stop_ids)} stop token ids (EOS included) exceed max_stop_token_ids={self.config.max_stop_token_ids}"
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this checkpoint has none (use stop_token_ids)")
        request_id = self._next_id
        self._next_id += 1
        max_output = limit - len(ids)
        if params.max_tokens is not None:
            max_output = min(max_output, params.max_tokens)
        seed = params.seed if params.seed is not None else (self.config.seed * 1_000_003 + request_id) % 2**32
        request = Request(request_id, ids, params, seed, stop_ids, max_output, prompt=prompt)
        if params.stop:
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, params.stop)
        return request

    def add(self, request: Request) -> None:
        with self._lock:
            self.scheduler.add(request)

    def abort(self, request_ids: int | Iterable[int]) -> None:
        """End these requests (waiting or running) with ``finish_reason="abort"``; their pages are freed.
        Ids of finished or unknown requests are ignored; an id that is not an int is an
        ``InvalidRequestError``. Safe to call from another thread: a step in progress finishes first."""
        single = is_integer(request_ids) or isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Iterable)
        ids = [request_ids] if single else list(request_ids)
        bad = [i for i in ids if not is_integer(i)]
        if bad:
            where = "" if single else f" (in {ids!r})"
            raise InvalidRequestError(f"request id {bad[0]!r}{where} is not an int: abort takes a request id "
                                      "(Request.request_id, GenerationOutput.request_id) or an iterable of them")
        ids = {int(i) for i in ids}
        with self._lock:
            self._pending_aborts |= ids
            if not self._stepping:
                self._apply_aborts()

    def _apply_aborts(self) -> None:
        for request_id in self._pending_aborts:
            request = self.scheduler.find(request_id)
            if request is not None:
                self._finish(request, "abort")
        self._pending_aborts.clear()

    def _finish(self, r: Request, reason: str, text: str | None = None) -> None:
        """End ``r`` with ``reason``; its text is ``text``, or its output decoded."""
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(r.output_token_ids, skip_special_tokens=r.params.skip_special_tokens)
        r.text = text or ""
        with self._lock:
            self.scheduler.finish(r, reason)

    # ---- the loop ------------------------------------------------------------------------------

    def run(self, requests: list[Request]) -> list[Request]:
        """Serve until ``requests`` (already added) have finished."""
        guard = CompileGuard.get().serving() if self.runner.strict else contextlib.nullcontext()
        with guard:
            while any(r.status is not RequestStatus.FINISHED for r in requests):
                self.step()
        return requests

    def step(self) -> list[Request]:
        """One device call; returns the requests that finished in it."""
        batch = None
        try:
            with self._lock:
                self._stepping = True
                self._apply_aborts()
                self._recover_caches()
                batch = self.scheduler.schedule()
            if batch is None:
                return []
            finished = self._run_mixed(batch) if isinstance(batch, MixedBatch) else self._run_decode(batch)
            if any(r.finish_reason == "error" for r in finished):  # logits that were not finite
                self._scrub_caches()
            return finished
        except BaseException as e:
            if batch is not None:
                with self._lock:
                    self._fail(batch, e)
            raise
        finally:
            with self._lock:
                self._stepping = False
                self._apply_aborts()

    def _scrub_caches(self) -> None:
        """After a request ended on logits that were not finite: its NaN / Inf may sit in its pages
        and slots, and a kernel that reads rows past a sequence's end (masked, but multiplied by 0)
        would carry them into whichever request gets those pages next. Re-make the caches; the
        running requests are recomputed from their tokens."""
        with self._lock:
            self.runner.allocate_caches()
            self.scheduler.preempt_all()

    def _recover_caches(self) -> None:
        """If a call consumed the caches without handing new ones back, re-make them; what the running
        requests had cached is gone, so they are recomputed."""
        if self.runner.recover_caches():
            self.scheduler.preempt_all()

    def _fail(self, batch: MixedBatch | DecodeBatch, error: BaseException) -> None:
        """End the failed call's requests, and leave the caches and pages consistent."""
        interrupted = isinstance(error, KeyboardInterrupt)
        requests = [r for r, _ in batch.items] if isinstance(batch, MixedBatch) else batch.requests
        for r in requests:
            if r.status is not RequestStatus.FINISHED:
                if not interrupted:
                    r.error = f"{type(error).__name__}: {error}"
                self.scheduler.finish(r, "abort" if interrupted else "error")  # text left undecoded: the
                # tokenizer may be what failed
        self._recover_caches()

    def _run_mixed(self, batch: MixedBatch) -> list[Request]:
        key = CompileKey(MIXED, bucket_for(batch.most_tokens_on_a_rank, self.grid.token_buckets),
                         self.config.max_num_seqs, self.config.max_pages_per_seq)
        tokens, logprobs = self.runner.run_mixed(key, batch.items)
        finished = []
        rows = rank_rows([r for r, _ in batch.items], key.num_seqs)
        for row, (r, n) in zip(rows, batch.items):
            r.num_computed += n
            if r.num_pending == 0:  # the whole sequence is in the cache: this row's sample is its next token
                if self._append(r, int(tokens[row]), logprobs, (row,)):
                    finished.append(r)
        return finished

    def _run_decode(self, batch: DecodeBatch) -> list[Request]:
        requests = batch.requests
        pages = max(len(r.pages) for r in requests)
        num_seqs = bucket_for(batch.most_seqs_on_a_rank, self.grid.seq_buckets)
        key = CompileKey(DECODE, num_seqs, num_seqs, bucket_for(pages, self.grid.page_buckets))
        tokens, logprobs = self.runner.run_decode(key, requests)
        finished = []
        for row, r in zip(rank_rows(requests, num_seqs), requests):
            for step in range(tokens.shape[0]):
                token = int(tokens[step, row])
                if token < 0 and token != NONFINITE_TOKEN:
                    break
                r.num_computed += 1
                if self._append(r, token, logprobs, (step, row)):
                    finished.append(r)
                    break
        return finished

    def _append(self, r: Request, token: int, logprobs, index) -> bool:
        """Record one generated token; finish the request if it hit a stop condition, or with
        ``"error"`` if its logits were not finite (``NONFINITE_TOKEN``, not recorded)."""
        if token == NONFINITE_TOKEN:
            r.error = self._nonfinite_message(r)
            self._finish(r, "error")
            return True
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        r.output_token_ids.append(token)
        if r.params.logprobs is not None and logprobs is not None:
            sampled, top_ids, top_values = (buf[index] for buf in logprobs)
            entry = {int(i): float(v) for i, v in zip(top_ids[: r.params.logprobs], top_values[: r.params.logprobs])}
            entry[token] = float(sampled)
            r.output_logprobs.append(entry)
        if token in r.stop_ids:
            self._finish(r, "stop")
        elif r.detokenizer is not None and r.detokenizer.add(r.output_token_ids):
            self._finish(r, "stop", r.detokenizer.text)  # cut where the stop string starts
        elif r.remaining_output <= 0:
            self._finish(r, "length")
        return r.status is RequestStatus.FINISHED

    def _nonfinite_message(self, r: Request) -> str:
        """``r.error`` when its next token's logits were not finite."""
        dtype = np.dtype(self.model.dtype).name
        wider = "" if dtype == "float32" else ", or serve the model in float32 (dtype=\"float32\"), which may help"
        return (f"the model's logits for generated token {len(r.output_token_ids) + 1} were not finite (NaN or Inf): "
                f"the computation overflowed {dtype}'s range or produced NaN; check the checkpoint's weights "
                f"(too large, or broken){wider}")
