"""``LLM``: the public offline-inference API."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence

import numpy as np

from jaxinfer import checks
from jaxinfer.config import ModelConfig
from jaxinfer.engine.aot import enable_compilation_cache
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.sampling import SamplingParams
from jaxinfer.errors import ConfigError, InvalidRequestError, TokenizerUnavailableError
from jaxinfer.generation_config import GenerationDefaults
from jaxinfer.loader import load_model
from jaxinfer.tokenizer import load_tokenizer, render_chat


@dataclasses.dataclass
class GenerationOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str  # "" when the checkpoint has no tokenizer
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop token or stop string), "length", or "abort" (LLM.abort)
    logprobs: list[dict[int, float]] | None  # per generated token: {token_id: logprob}, top-N + the sampled one


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
    """

    def __init__(self, model: str | os.PathLike, dtype: str = "auto", *, engine_config: EngineConfig | None = None,
                 mesh=None, skip_tokenizer_init: bool = False, **engine_options):
        path = os.fspath(model)
        config = engine_config or EngineConfig()
        unknown = set(engine_options) - {f.name for f in dataclasses.fields(EngineConfig)}
        if unknown:
            raise ConfigError(f"unknown LLM options {sorted(unknown)}; the engine options are the fields of "
                              "jaxinfer.EngineConfig")
        config = dataclasses.replace(config, **engine_options)
        # Everything that can be wrong with the options, the tokenizer and the generation config is
        # found before the weights are read.
        config.validate()
        model_config = ModelConfig.from_pretrained(path)
        config = config.for_model(model_config)
        self.tokenizer = None if checks.boolean(skip_tokenizer_init, "skip_tokenizer_init") else load_tokenizer(path)
        generation = GenerationDefaults.read(path, model_config.vocab_size)
        if config.cache_dir():  # before loading: the weight checks compile too
            enable_compilation_cache(config.cache_dir())
        self.model = load_model(path, dtype, mesh=mesh, progress=config.show_progress)
        self.engine = Engine(self.model, config, tokenizer=self.tokenizer, generation_defaults=generation)

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
        try:
            for r in requests:
                self.engine.add(r)
            self.engine.run(requests)
        except BaseException:
            self.engine.abort(r.request_id for r in requests)
            raise
        return [
            GenerationOutput(r.request_id, r.prompt, r.prompt_token_ids, r.text, list(r.output_token_ids),
                             r.finish_reason, r.output_logprobs if r.params.logprobs is not None else None)
            for r in requests
        ]

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
