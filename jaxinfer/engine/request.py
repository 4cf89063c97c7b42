"""One generation request and what the engine tracks about it."""

from __future__ import annotations

import dataclasses
import enum

from jaxinfer.engine.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class Request:
    """Token bookkeeping: ``all_token_ids = prompt + output``; the first ``num_computed`` of them have
    their K/V in the cache. A running request always has at least one token not yet computed (the
    last sampled one, in decode), so ``num_pending >= 1``. Preemption drops the pages and the state
    slot and sets ``num_computed`` to 0: the request is recomputed from its prompt and outputs.
    """

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    stop_ids: tuple[int, ...]  # EOS (unless ignore_eos) + stop_token_ids
    max_output_tokens: int  # from max_tokens and the model length
    prompt: str | None = None
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[dict] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    num_released_pages: int = 0  # leading pages given back after they slid out of every layer's window
    slot: int | None = None  # the state slot, for models with per-sequence state (held while running)
    rank: int = 0  # the data-parallel rank whose pages, slot and step rows it has while running
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    error: str | None = None  # what failed, when finish_reason is "error"
    text: str = ""
    num_preemptions: int = 0
    detokenizer: object | None = None  # IncrementalDetokenizer, where stop strings are watched for

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def remaining_output(self) -> int:
        return self.max_output_tokens - len(self.output_token_ids)

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def tokens(self, start: int, stop: int) -> list[int]:
        """``all_token_ids[start:stop]`` without building the whole list (a prefill chunk's tokens)."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[start:min(stop, n)] + self.output_token_ids[max(start - n, 0):max(stop - n, 0)]
