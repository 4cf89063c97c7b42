"""Engine settings and the shape buckets they imply."""

from __future__ import annotations

import dataclasses
import os

from jaxinfer import checks
from jaxinfer.cache import fp8
from jaxinfer.errors import ConfigError


DEFAULT_MAX_MODEL_LEN_CAP = 8192  # an unset max_model_len is the model's own, capped here
DEFAULT_PAGE_SIZE = 16


@dataclasses.dataclass
class EngineConfig:
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped at 8192
    # Serve a max_model_len beyond the model's max_position_embeddings (positions it was not trained on).
    allow_long_max_model_len: bool = False
    # Sequences, tokens and pages are each data-parallel rank's (as vLLM's per-rank engines count them).
    max_num_seqs: int = 8  # sequences per step
    max_num_batched_tokens: int = 512  # tokens per mixed (prefill) step
    page_size: int = DEFAULT_PAGE_SIZE
    num_pages: int | None = None  # default: every sequence at full length, capped by free device / host memory
    kv_cache_memory_fraction: float = 0.85  # of the memory left after weights (host memory on CPU)
    # "auto": paged cache arrays in the compute dtype; "fp8" (or "fp8_e4m3"): float8_e4m3fn with a
    # per-layer scale (the checkpoint's k_scale / v_scale, else 1.0; jaxinfer.cache.fp8).
    kv_cache_dtype: str = "auto"
    decode_steps: int = 8  # decode steps per device-side loop
    max_logprobs: int | None = 5  # the largest SamplingParams.logprobs served; None: logprobs are not served
    max_stop_token_ids: int = 8  # EOS ids + stop_token_ids per request
    min_token_bucket: int = 16
    # Ratio between the decode loops' block-table buckets (1, g, g^2, ... pages, then the maximum);
    # 2 gives the finest grid. Each bucket is a compiled program per sequence bucket.
    page_bucket_growth: int = 4
    strict: bool = False  # raise if anything is traced or compiled after warm-up
    warmup: bool = True  # compile the whole bucket grid at start-up
    compilation_cache: bool = True  # persistent XLA compilation cache: a second start-up reads, not compiles
    compilation_cache_dir: str | None = None  # its folder (default: xla-cache under $JAXINFER_HOME or ~/.cache/jaxinfer)
    seed: int = 0  # base of the per-request seeds for requests that give none
    show_progress: bool = True
    tensor_parallel_size: int = 1  # devices each layer is split over (heads, MLP width, vocabulary)
    data_parallel_size: int = 1  # ranks of tensor_parallel_size devices, each serving its own sequences
    enable_expert_parallel: bool = False  # MoE experts split whole over the devices instead of by width

    def validate(self) -> None:
        """``ConfigError`` naming any option of the wrong type or out of range."""
        def name(field):
            return f"EngineConfig.{field}"

        for field in ("max_num_seqs", "max_num_batched_tokens", "page_size", "decode_steps", "min_token_bucket",
                      "max_stop_token_ids", "tensor_parallel_size", "data_parallel_size"):
            checks.integer(getattr(self, field), name(field), ge=1)
        checks.integer(self.page_bucket_growth, name("page_bucket_growth"), ge=2)
        for field in ("max_model_len", "num_pages"):
            checks.optional(checks.integer, getattr(self, field), name(field), ge=1)
        checks.optional(checks.integer, self.max_logprobs, name("max_logprobs"), ge=0)
        checks.integer(self.seed, name("seed"), ge=0)
        checks.number(self.kv_cache_memory_fraction, name("kv_cache_memory_fraction"), gt=0, le=1)
        fp8.kv_cache_dtype(self.kv_cache_dtype)
        for field in ("allow_long_max_model_len", "strict", "warmup", "compilation_cache", "show_progress",
                      "enable_expert_parallel"):
            checks.boolean(getattr(self, field), name(field))
        if self.compilation_cache_dir is not None and not isinstance(self.compilation_cache_dir, str):
            raise ConfigError(f"{name('compilation_cache_dir')} must be a path string, got {self.compilation_cache_dir!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): a mixed step carries one token of every running sequence"
            )
        if self.strict and not self.warmup:
            raise ConfigError("strict mode needs warmup=True: it forbids compiling after the warm-up")
        if self.max_model_len is not None:
            most = max(1 << (self.max_model_len - 1).bit_length(), DEFAULT_PAGE_SIZE)
            if self.page_size > most:
                raise ConfigError(
                    f"EngineConfig.page_size={self.page_size} exceeds max_model_len={self.max_model_len}: a page holds "
                    f"tokens of one sequence, so its slots past {most} (max_model_len rounded up to a power of two, "
                    f"at least {DEFAULT_PAGE_SIZE}) would stay empty; use a page_size <= {most}")
        if self.num_pages is not None and self.num_pages * self.page_size >= 2**31:
            raise ConfigError(f"{name('num_pages')}={self.num_pages} x page_size={self.page_size} = "
                              f"{self.num_pages * self.page_size} cache rows, which int32 indices cannot address: keep "
                              "num_pages * page_size below 2**31")

    @property
    def kv_dtype(self):
        """The paged cache arrays' dtype ``kv_cache_dtype`` asks for; None: the compute dtype."""
        return fp8.kv_cache_dtype(self.kv_cache_dtype)

    def parallelism(self) -> dict:
        """The options that partition the model (``jaxinfer.load_model``'s keywords)."""
        return dict(tensor_parallel_size=self.tensor_parallel_size, data_parallel_size=self.data_parallel_size,
                    enable_expert_parallel=self.enable_expert_parallel)

    def for_model(self, model_config) -> "EngineConfig":
        """A validated copy with ``max_model_len`` resolved for the model: its
        ``max_position_embeddings`` (capped at ``DEFAULT_MAX_MODEL_LEN_CAP``) when unset; beyond it only
        with ``allow_long_max_model_len``."""
        config = dataclasses.replace(self)
        config.validate()
        limit = model_config.max_position_embeddings
        if config.max_model_len is None:
            config.max_model_len = min(limit, DEFAULT_MAX_MODEL_LEN_CAP)
            config.validate()  # again: the checks that need max_model_len
        elif config.max_model_len > limit and not config.allow_long_max_model_len:
            raise ConfigError(
                f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings ({limit}), "
                "positions it was not trained on; lower it, or pass allow_long_max_model_len=True to serve it anyway"
            )
        return config

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    def cache_dir(self) -> str | None:
        """The persistent compilation cache's folder, or None when it is off."""
        if not self.compilation_cache:
            return None
        if self.compilation_cache_dir:
            return self.compilation_cache_dir
        from jaxinfer.tiny import jaxinfer_home

        return os.path.join(jaxinfer_home(), "xla-cache")


def geometric_buckets(low: int, high: int, growth: int = 2) -> tuple[int, ...]:
    """low, growth*low, growth^2*low, ... below ``high``, then ``high`` itself."""
    out, b = [], max(1, low)
    while b < high:
        out.append(b)
        b *= growth
    out.append(high)
    return tuple(out)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
