"""Engine settings and the shape buckets they imply."""

from __future__ import annotations

import dataclasses

from jaxinfer.errors import ConfigError


@dataclasses.dataclass
class EngineConfig:
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped at 8192
    max_num_seqs: int = 8  # sequences per step
    max_num_batched_tokens: int = 512  # tokens per mixed (prefill) step
    page_size: int = 16
    num_pages: int | None = None  # default: every sequence at full length, capped by free accelerator memory
    kv_cache_memory_fraction: float = 0.85  # of the accelerator memory left after weights
    decode_steps: int = 8  # decode steps per device-side loop
    max_logprobs: int = 5  # the largest SamplingParams.logprobs served; 0 skips the computation
    max_stop_token_ids: int = 8  # EOS ids + stop_token_ids per request
    min_token_bucket: int = 16
    strict: bool = False  # raise if anything is traced or compiled after warm-up
    warmup: bool = True  # compile the whole bucket grid at start-up
    compilation_cache_dir: str | None = None  # persistent XLA compilation cache
    seed: int = 0  # base of the per-request seeds for requests that give none
    show_progress: bool = True

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "decode_steps", "min_token_bucket"):
            if getattr(self, name) < 1:
                raise ConfigError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): a mixed step carries one token of every running sequence"
            )
        if self.strict and not self.warmup:
            raise ConfigError("strict mode needs warmup=True: it forbids compiling after the warm-up")

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)


def power_of_two_buckets(low: int, high: int) -> tuple[int, ...]:
    """low, 2*low, 4*low, ... below ``high``, then ``high`` itself."""
    out, b = [], max(1, low)
    while b < high:
        out.append(b)
        b *= 2
    out.append(high)
    return tuple(out)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
