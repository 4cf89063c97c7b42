"""``LLM``: the public offline-inference API."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.sampling import SamplingParams
from jaxinfer.errors import InvalidRequestError, TokenizerUnavailableError
from jaxinfer.loader import load_model
from jaxinfer.tokenizer import load_tokenizer


@dataclasses.dataclass
class GenerationOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str  # "" when the checkpoint has no tokenizer
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    logprobs: list[dict[int, float]] | None  # per generated token: {token_id: logprob}, top-N + the sampled one


class LLM:
    """Load a HuggingFace checkpoint folder, compile the engine's buckets, and generate.

    ``LLM(path, dtype="bfloat16", max_model_len=4096)``; any ``EngineConfig`` field can be passed as
    a keyword (``max_num_seqs=16``, ``strict=True``, ...), or a whole ``engine_config``.
    """

    def __init__(self, model: str | os.PathLike, dtype: str = "auto", *, engine_config: EngineConfig | None = None,
                 mesh=None, **engine_options):
        path = os.fspath(model)
        config = engine_config or EngineConfig()
        unknown = set(engine_options) - {f.name for f in dataclasses.fields(EngineConfig)}
        if unknown:
            raise TypeError(f"unknown LLM options {sorted(unknown)}; see jaxinfer.EngineConfig")
        config = dataclasses.replace(config, **engine_options)
        self.model = load_model(path, dtype, mesh=mesh, progress=config.show_progress)
        self.tokenizer = load_tokenizer(path)
        self.engine = Engine(self.model, config, tokenizer=self.tokenizer)

    @property
    def config(self):
        return self.model.config

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise TokenizerUnavailableError(
                f"{self.model.path!r} has no tokenizer files: pass prompt_token_ids instead of text"
            )
        return self.tokenizer

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None) -> list[GenerationOutput]:
        """Generate for text prompts or token-id prompts (one or a list); outputs keep the input order."""
        if (prompts is None) == (prompt_token_ids is None):
            raise InvalidRequestError("give exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            texts = [prompts] if isinstance(prompts, str) else list(prompts)
            if not all(isinstance(p, str) for p in texts):
                raise InvalidRequestError("prompts must be strings; pass token ids through prompt_token_ids")
            tokenizer = self._require_tokenizer()
            id_lists = [tokenizer.encode(p) if p else [] for p in texts]
        else:
            ids = list(prompt_token_ids)
            id_lists = [ids] if ids and not isinstance(ids[0], (list, tuple)) else [list(p) for p in ids]
            texts = [None] * len(id_lists)
        if not id_lists:
            return []
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = [sampling_params] * len(id_lists) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params_list) != len(id_lists):
            raise InvalidRequestError(f"{len(params_list)} sampling_params for {len(id_lists)} prompts")
        # Validate every request before queueing any, so one bad prompt loses nothing.
        requests = [self.engine.make_request(ids, p, prompt=t) for ids, p, t in zip(id_lists, params_list, texts)]
        for r in requests:
            self.engine.add(r)
        self.engine.run(requests)
        return [
            GenerationOutput(r.request_id, r.prompt, r.prompt_token_ids, r.text, list(r.output_token_ids),
                             r.finish_reason, r.output_logprobs if r.params.logprobs is not None else None)
            for r in requests
        ]

    def chat(self, messages, sampling_params: SamplingParams | None = None, *,
             add_generation_prompt: bool = True) -> list[GenerationOutput]:
        """``messages``: one conversation (a list of {"role", "content"} dicts) or a list of them."""
        tokenizer = self._require_tokenizer()
        if not getattr(tokenizer, "chat_template", None):
            raise TokenizerUnavailableError(f"the tokenizer of {self.model.path!r} has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        id_lists = [
            list(tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt, tokenize=True,
                                               return_dict=False))
            for c in conversations
        ]
        return self.generate(sampling_params=sampling_params, prompt_token_ids=id_lists)
