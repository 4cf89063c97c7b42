"""``LLM``: the public offline-inference API."""

from __future__ import annotations

import atexit
import dataclasses
import os
import time
from collections.abc import Iterable, Sequence

import numpy as np

from jaxinfer import checks
from jaxinfer.config import ModelConfig
from jaxinfer.engine import multihost
from jaxinfer.engine.aot import CompileGuard, enable_compilation_cache
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.sampling import SamplingParams
from jaxinfer.engine.startup import StartupReport, process_age
from jaxinfer.errors import ConfigError, InvalidRequestError, TokenizerUnavailableError
from jaxinfer.generation_config import GenerationDefaults
from jaxinfer.loader import check_quantization_mode, load_model
from jaxinfer.tokenizer import check_text, load_tokenizer, render_chat


@dataclasses.dataclass
class GenerationOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str  # "" when the checkpoint has no tokenizer
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop token or stop string), "length", "abort" (LLM.abort) or "error"
    logprobs: list[dict[int, float]] | None  # per generated token: {token_id: logprob}, top-N + the sampled one
    error: str | None = None  # why, when finish_reason is "error" (e.g. logits that were not finite)


def _is_token_ids(value) -> bool:
    """A single token-id prompt: a 1-D integer array, or a list/tuple whose items are integers."""
    if isinstance(value, np.ndarray):
        return value.ndim == 1
    return isinstance(value, (list, tuple)) and len(value) > 0 and checks.is_integer(value[0])


class LLM:
    """Load a HuggingFace checkpoint folder, compile the engine's buckets, and generate.

    ``LLM(path, dtype="bfloat16", max_model_len=4096)``; any ``EngineConfig`` field can be passed as
    a keyword (``max_num_seqs=16``, ``strict=True``, ...), or a whole ``engine_config``.
    ``skip_tokenizer_init=True`` serves token ids only, without loading the tokenizer.

    ``executables=EXPORT_DIR`` serves the programs of an export (``LLM.export``, ``jaxinfer export``)
    instead of compiling: nothing is traced or compiled (``warmup=False``: each program is
    deserialized on its first use instead of at start-up). The export fixes the options its programs
    depend on; options left out take its values, options given must agree with them. An export made
    for another checkpoint, config, option, jax version or device is refused before anything is
    loaded (``ExportMismatchError``). An export directory is read as data (no pickle; every read
    confined to it); its executables are compiled device code (see ``jaxinfer.engine.export``).

    ``quantization="auto"`` keeps an fp8 checkpoint's weights in fp8 on the device (None: dequantized
    to ``dtype`` on load; ``jaxinfer.quantization``). ``kv_cache_dtype="fp8"`` (an ``EngineConfig``
    option) keeps the paged KV cache in float8_e4m3fn with per-layer scales (``jaxinfer.cache.fp8``).

    ``tensor_parallel_size=T`` splits each layer over ``T`` devices (``enable_expert_parallel=True``:
    MoE experts split whole); ``mesh`` gives a custom mesh instead (``jaxinfer.sharding.make_mesh``).
    On several hosts, every host runs the same script with ``coordinator_address="HOST:PORT"``,
    ``num_processes`` and its ``process_id`` (or jax's environment variables): process 0 generates
    and ends with ``shutdown()``, the others call ``follow()`` (``jaxinfer.engine.multihost``).

    ``startup_report`` says where start-up time went (``jaxinfer.engine.startup.StartupReport``).
    """

    def __init__(self, model: str | os.PathLike, dtype: str = "auto", *, quantization: str | None = "auto",
                 engine_config: EngineConfig | None = None,
                 mesh=None, skip_tokenizer_init: bool = False, executables: str | os.PathLike | None = None,
                 coordinator_address: str | None = None, num_processes: int | None = None,
                 process_id: int | None = None, **engine_options):
        started = time.perf_counter()
        check_quantization_mode(quantization)
        multihost.initialize(coordinator_address, num_processes, process_id)
        self.startup_report = StartupReport(imports_s=process_age())
        path = os.fspath(model)
        config = engine_config or EngineConfig()
        unknown = set(engine_options) - {f.name for f in dataclasses.fields(EngineConfig)}
        if unknown:
            raise ConfigError(f"unknown LLM options {sorted(unknown)}; the engine options are the fields of "
                              "jaxinfer.EngineConfig")
        explicit = _explicit_options(engine_config, engine_options)
        config = dataclasses.replace(config, **engine_options)
        # Everything that can be wrong with the options, the export, the tokenizer and the generation
        # config is found before the weights are read.
        config.validate()
        with CompileGuard.get().counting() as count:
            if executables is not None:
                from jaxinfer.engine.export_loading import open_export

                export = open_export(os.fspath(executables), path, dtype, explicit, config, mesh)
                config, model_config = export.config, export.model_config
            else:
                export = None
                model_config = ModelConfig.from_pretrained(path)
                config = config.for_model(model_config)
            self.tokenizer = None if checks.boolean(skip_tokenizer_init, "skip_tokenizer_init") else load_tokenizer(path)
            generation = GenerationDefaults.read(path, model_config.vocab_size)
            if config.cache_dir():  # before loading: the weight checks compile too
                enable_compilation_cache(config.cache_dir())
            if export is not None:
                self.model = export.load_model(quantization=quantization, progress=config.show_progress)
            else:
                self.model = load_model(path, dtype, quantization=quantization, mesh=mesh,
                                        progress=config.show_progress, **config.parallelism())
            loaded = time.perf_counter()
            self.engine = Engine(self.model, config, tokenizer=self.tokenizer, generation_defaults=generation,
                                 programs=None if export is None else export.programs)
        if self.engine.runner.leader is not None:
            atexit.register(self.engine.shutdown)
        report, phases = self.startup_report, self.engine.startup_seconds
        report.config_and_weights_s = loaded - started
        report.cache_allocation_s = phases["cache_allocation_s"]
        report.lowering_s = phases["lowering_s"]
        report.compiling_s = phases["compiling_s"]
        report.programs_compiled, report.programs_from_cache = count(), count.cache_reads
        if export is not None:
            report.source = "export"
            report.programs_from_export = export.programs.num_loaded

    @property
    def is_leader(self) -> bool:
        """Whether this process schedules (process 0; the only one on one host)."""
        return multihost.is_leader()

    def follow(self) -> int:
        """On every process but 0 of a multi-host engine: run the device calls process 0 sends until it
        calls ``shutdown()`` (or exits) -> the calls made."""
        return self.engine.follow()

    def shutdown(self) -> None:
        """On process 0 of a multi-host engine: release the other processes from ``follow()``."""
        self.engine.shutdown()

    def export(self, directory: str | os.PathLike, *, portable: bool = False):
        """Write this engine's programs (the whole grid, compiled afresh: an executable read from the
        persistent compilation cache cannot be serialized again) and their manifest to ``directory``
        (see ``jaxinfer.engine.export``); serve them with ``LLM(path, executables=directory)``.
        ``portable``: StableHLO (``jax.export``) for every program whose custom calls are all
        export-stable. -> the ``Manifest``."""
        from jaxinfer.engine.export import write_export

        return write_export(self.engine, os.fspath(directory), portable=checks.boolean(portable, "portable"),
                            progress=self.engine.config.show_progress)

    @property
    def config(self):
        return self.model.config

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses when given no ``sampling_params``: the checkpoint's
        ``generation_config.json`` as HF's ``generate()`` reads it (greedy unless it sets
        ``do_sample``), else ``SamplingParams()``."""
        defaults = self.engine.generation_defaults
        return SamplingParams(**defaults.sampling) if defaults is not None else SamplingParams()

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise TokenizerUnavailableError(
                f"{self.model.path!r} is served without a tokenizer: pass token ids (prompt_token_ids, or "
                "{'prompt_token_ids': [...]} prompts) instead of text"
            )
        return self.tokenizer

    def _parse_prompt(self, prompt, index: int) -> tuple[str | None, object]:
        """One prompt -> (its text or None, its token ids, unchecked)."""
        if isinstance(prompt, str):
            check_text(prompt, f"prompt {index}")
            return prompt, (self._require_tokenizer().encode(prompt) if prompt else [])
        if isinstance(prompt, dict):
            keys = set(prompt)
            if keys == {"prompt"} and isinstance(prompt["prompt"], str):
                return self._parse_prompt(prompt["prompt"], index)
            if keys == {"prompt_token_ids"}:
                return None, prompt["prompt_token_ids"]
            raise InvalidRequestError(
                f"prompt {index} is a dict with keys {sorted(keys)}; give {{'prompt': str}} or "
                "{'prompt_token_ids': [int, ...]}"
            )
        if _is_token_ids(prompt):
            return None, prompt
        raise InvalidRequestError(
            f"prompt {index} is a {type(prompt).__name__}; give a string, {{'prompt': str}}, "
            "{'prompt_token_ids': [int, ...]} or a list of token ids"
        )

    def _prompt_list(self, prompts, prompt_token_ids) -> list[tuple[str | None, object]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise InvalidRequestError("give exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            single = isinstance(prompts, (str, dict)) or _is_token_ids(prompts)
            items = [prompts] if single else prompts
        else:
            items = [prompt_token_ids] if _is_token_ids(prompt_token_ids) else prompt_token_ids
            items = [{"prompt_token_ids": p} for p in items] if isinstance(items, (list, tuple)) else items
        if not isinstance(items, (list, tuple)):
            raise InvalidRequestError(f"prompts must be a prompt or a list of them, got {type(items).__name__}")
        return [self._parse_prompt(p, i) for i, p in enumerate(items)]

    def generate(self, prompts=None, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None) -> list[GenerationOutput]:
        """Generate for one prompt or a list; outputs keep the input order.

        A prompt is a string, ``{"prompt": str}``, ``{"prompt_token_ids": [...]}`` or a list of token
        ids (also accepted through ``prompt_token_ids``). Every request is checked before any is
        queued, so one bad prompt loses nothing. If serving fails or is interrupted, this call's
        requests are aborted (nothing of them is served later) and the exception reaches the caller.
        """
        parsed = self._prompt_list(prompts, prompt_token_ids)
        if not parsed:
            return []
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(parsed)
        elif isinstance(sampling_params, (list, tuple)):
            params_list = list(sampling_params)
        else:
            raise InvalidRequestError(
                f"sampling_params must be SamplingParams or a list of them, got {type(sampling_params).__name__}"
            )
        if len(params_list) != len(parsed):
            raise InvalidRequestError(f"{len(params_list)} sampling_params for {len(parsed)} prompts")
        requests = [self.engine.make_request(ids, p, prompt=text) for (text, ids), p in zip(parsed, params_list)]
        called = time.perf_counter()
        try:
            for r in requests:
                self.engine.add(r)
            self.engine.run(requests)
        except BaseException:
            self.engine.abort(r.request_id for r in requests)
            raise
        finally:
            self._note_first_token(called)
        return [
            GenerationOutput(r.request_id, r.prompt, r.prompt_token_ids, r.text, list(r.output_token_ids),
                             r.finish_reason, r.output_logprobs if r.params.logprobs is not None else None, r.error)
            for r in requests
        ]

    def _note_first_token(self, called: float) -> None:
        report, first = self.startup_report, self.engine.first_token_at
        if report.first_token_s is None and first is not None:
            report.first_token_s = max(0.0, first - called)
            age = process_age()
            report.to_first_token_s = None if age is None else max(0.0, age - (time.perf_counter() - first))

    def abort(self, request_ids: int | Iterable[int]) -> None:
        """Abort requests by id (from another thread, while ``generate`` runs): they finish with
        ``finish_reason="abort"`` and the tokens they have so far."""
        self.engine.abort(request_ids)

    def chat(self, messages, sampling_params: SamplingParams | None = None, *,
             add_generation_prompt: bool = True) -> list[GenerationOutput]:
        """``messages``: one conversation (a list of {"role", "content"} dicts) or a list of them,
        rendered by the tokenizer's chat template (transformers' sandboxed Jinja)."""
        tokenizer = self._require_tokenizer()
        if not getattr(tokenizer, "chat_template", None):
            raise TokenizerUnavailableError(f"the tokenizer of {self.model.path!r} has no chat template")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidRequestError("messages must be a conversation (a list of message dicts) or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        id_lists = render_chat(tokenizer, conversations, checks.boolean(add_generation_prompt, "add_generation_prompt",
                                                                        error=InvalidRequestError))
        return self.generate(sampling_params=sampling_params, prompt_token_ids=id_lists)


def _explicit_options(engine_config: EngineConfig | None, engine_options: dict) -> dict:
    """The engine options the caller set: the keywords, and the fields of ``engine_config`` that
    differ from the defaults."""
    given = dict(engine_options)
    if engine_config is not None:
        defaults = EngineConfig()
        for field in dataclasses.fields(EngineConfig):
            value = getattr(engine_config, field.name)
            if field.name not in given and value != getattr(defaults, field.name):
                given[field.name] = value
    return given
