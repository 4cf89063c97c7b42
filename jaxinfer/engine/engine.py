"""The serving loop: requests in, scheduler decides, runner executes, outputs out."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import time

import jax

from jaxinfer.cache.allocator import PageAllocator
from jaxinfer.cache.layout import KVCacheLayout
from jaxinfer.engine.aot import DECODE, MIXED, BucketGrid, CompileGuard, CompileKey, enable_compilation_cache
from jaxinfer.engine.config import EngineConfig, bucket_for
from jaxinfer.engine.request import Request, RequestStatus
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.sampling import SamplingParams
from jaxinfer.engine.scheduler import DecodeBatch, MixedBatch, Scheduler
from jaxinfer.errors import ConfigError, InvalidRequestError
from jaxinfer.loader import LoadedModel, validate_token_ids

_MAX_MODEL_LEN_CAP = 8192  # default max_model_len: the model's own, capped here


def read_eos_token_ids(model: LoadedModel, tokenizer=None) -> tuple[int, ...]:
    """generation_config.json's eos_token_id, else config.json's, else the tokenizer's."""
    path = os.path.join(model.path, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            return (eos,) if isinstance(eos, int) else tuple(eos)
    if model.config.eos_token_ids:
        return model.config.eos_token_ids
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return (tokenizer.eos_token_id,)
    return ()


def _default_num_pages(config: EngineConfig, page_bytes: int) -> int:
    """Enough pages for every sequence slot at full length, fewer if accelerator memory is short.

    More would sit unused: without a prefix cache no page outlives its request.
    """
    most_usable = config.max_num_seqs * config.max_pages_per_seq
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        return min(most_usable, int(free * config.kv_cache_memory_fraction) // page_bytes)
    return most_usable


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig | None = None, *, tokenizer=None):
        config = dataclasses.replace(config) if config is not None else EngineConfig()
        if config.max_model_len is None:
            config.max_model_len = min(model.config.max_position_embeddings, _MAX_MODEL_LEN_CAP)
        config.validate()
        self.model = model
        self.config = config
        specs = model.model_cls.kv_cache_specs(model.config)
        page_bytes = KVCacheLayout.bytes_per_page_for(specs, config.page_size, model.dtype)
        num_pages = config.num_pages or _default_num_pages(config, page_bytes)
        if num_pages < config.max_pages_per_seq:
            raise ConfigError(
                f"{num_pages} KV pages cannot hold one sequence of max_model_len={config.max_model_len} "
                f"({config.max_pages_per_seq} pages of {config.page_size}); lower max_model_len or add pages"
            )
        config.num_pages = num_pages
        self.layout = KVCacheLayout(specs, config.page_size, num_pages, model.dtype)
        self.eos_token_ids = read_eos_token_ids(model, tokenizer)
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(config, PageAllocator(num_pages))
        self.runner = ModelRunner(model, config, self.layout)
        self.grid = BucketGrid.from_config(config)
        self._next_id = 0
        self.warmup_seconds = None
        if config.compilation_cache_dir:
            enable_compilation_cache(config.compilation_cache_dir)
        if config.warmup:
            self.warmup()

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
        self.warmup_seconds = time.perf_counter() - start
        self.runner.strict = self.config.strict

    # ---- requests ------------------------------------------------------------------------------

    def make_request(self, prompt_token_ids, params: SamplingParams, prompt: str | None = None) -> Request:
        """Validate everything about one request; nothing is queued here."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        ids = validate_token_ids(prompt_token_ids, self.model.config.vocab_size)
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; max_model_len is {limit}, which leaves no room to generate "
                "(shorten the prompt or raise max_model_len)"
            )
        if params.logprobs and params.logprobs > self.config.max_logprobs:
            raise InvalidRequestError(
                f"logprobs={params.logprobs} exceeds the engine's max_logprobs={self.config.max_logprobs}"
            )
        stop_ids = tuple(dict.fromkeys((() if params.ignore_eos else self.eos_token_ids) + tuple(params.stop_token_ids or ())))
        if len(stop_ids) > self.config.max_stop_token_ids:
            raise InvalidRequestError(
                f"{len(stop_ids)} stop token ids (EOS included) exceed max_stop_token_ids={self.config.max_stop_token_ids}"
            )
        bad_stop = [t for t in stop_ids if t >= self.model.config.vocab_size]
        if bad_stop:
            raise InvalidRequestError(f"stop_token_ids outside the vocabulary: {bad_stop}")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this checkpoint has none (use stop_token_ids)")
        request_id = self._next_id
        self._next_id += 1
        max_output = limit - len(ids)
        if params.max_tokens is not None:
            max_output = min(max_output, params.max_tokens)
        seed = params.seed if params.seed is not None else (self.config.seed * 1_000_003 + request_id) % 2**32
        return Request(request_id, ids, params, seed, stop_ids, max_output, prompt=prompt)

    def add(self, request: Request) -> None:
        self.scheduler.add(request)

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
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        if isinstance(batch, MixedBatch):
            return self._run_mixed(batch)
        return self._run_decode(batch)

    def _run_mixed(self, batch: MixedBatch) -> list[Request]:
        key = CompileKey(MIXED, bucket_for(batch.num_tokens, self.grid.token_buckets),
                         self.config.max_num_seqs, self.config.max_pages_per_seq)
        tokens, logprobs = self.runner.run_mixed(key, batch.items)
        finished = []
        for row, (r, n) in enumerate(batch.items):
            r.num_computed += n
            if r.num_pending == 0:  # the whole sequence is in the cache: this row's sample is its next token
                if self._append(r, int(tokens[row]), logprobs, (row,)):
                    finished.append(r)
        return finished

    def _run_decode(self, batch: DecodeBatch) -> list[Request]:
        requests = batch.requests
        pages = max(len(r.pages) for r in requests)
        num_seqs = bucket_for(len(requests), self.grid.seq_buckets)
        key = CompileKey(DECODE, num_seqs, num_seqs, bucket_for(pages, self.grid.page_buckets))
        tokens, logprobs = self.runner.run_decode(key, requests)
        finished = []
        for row, r in enumerate(requests):
            for step in range(tokens.shape[0]):
                token = int(tokens[step, row])
                if token < 0:
                    break
                r.num_computed += 1
                if self._append(r, token, logprobs, (step, row)):
                    finished.append(r)
                    break
        return finished

    def _append(self, r: Request, token: int, logprobs, index) -> bool:
        """Record one generated token; finish the request if it hit a stop condition."""
        r.output_token_ids.append(token)
        if r.params.logprobs is not None and logprobs is not None:
            sampled, top_ids, top_values = (buf[index] for buf in logprobs)
            entry = {int(i): float(v) for i, v in zip(top_ids[: r.params.logprobs], top_values[: r.params.logprobs])}
            entry[token] = float(sampled)
            r.output_logprobs.append(entry)
        reason, text_done = None, False
        if token in r.stop_ids:
            reason = "stop"
        elif r.params.stop and self._truncate_at_stop_string(r):
            reason, text_done = "stop", True
        elif r.remaining_output <= 0:
            reason = "length"
        if reason is None:
            return False
        r.finish_reason = reason
        if self.tokenizer is not None and not text_done:
            r.text = self.tokenizer.decode(r.output_token_ids, skip_special_tokens=r.params.skip_special_tokens)
        self.scheduler.finish(r)
        return True

    def _truncate_at_stop_string(self, r: Request) -> bool:
        text = self.tokenizer.decode(r.output_token_ids, skip_special_tokens=r.params.skip_special_tokens)
        hits = [text.find(s) for s in r.params.stop if s in text]
        if not hits:
            return False
        r.text = text[: min(hits)]
        return True

