"""Sampling parameters (host side) and the jitted sampler (device side).

Order of the filters, as in HF's generation warpers: temperature -> top-k -> top-p -> min-p; then
one draw. ``temperature == 0`` is greedy (argmax of the raw logits). Each request draws with the key
``fold_in(PRNGKey(seed), n)`` for its n-th generated token, so its samples do not depend on which
other requests share the batch, nor on preemption and recompute. A row whose logits are not finite
(a NaN, a +Inf, or nothing but -Inf) samples ``NONFINITE_TOKEN`` instead: the engine ends its
request with an error rather than serve the argmax of NaNs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer import checks
from jaxinfer.errors import InvalidRequestError

NONFINITE_TOKEN = -2  # the token of a row whose logits are not finite (-1: no token, in the decode loop)


@dataclasses.dataclass
class SamplingParams:
    """How one request samples and when it stops. Every field is type- and range-checked when the
    object is built (and again when a request is made from it); ``InvalidRequestError`` names it."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables; at most the vocabulary size (checked by the engine)
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until the model length
    stop: str | list[str] | None = None  # stop strings; not included in the output
    stop_token_ids: list[int] | None = None  # also stop on these (the token is kept in token_ids)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token, plus the sampled one's (0: that alone)
    skip_special_tokens: bool = True
    n: int = 1  # vLLM's outputs per request; one for now
    best_of: int | None = None  # vLLM's candidates per request, the best n returned; one for now

    def __post_init__(self):
        error = InvalidRequestError
        for field, value in (("n", self.n), ("best_of", 1 if self.best_of is None else self.best_of)):
            if not (checks.is_integer(value) and value == 1):
                raise error(f"SamplingParams.{field} must be 1, got {value!r}: jaxinfer serves one output per request "
                            "for now; for k samples of a prompt, send it k times with different seeds "
                            "(sampling_params=[SamplingParams(seed=s) for s in range(k)])")
        self.n, self.best_of = 1, None if self.best_of is None else 1
        self.temperature = checks.number(self.temperature, "SamplingParams.temperature", ge=0, error=error)
        self.top_p = checks.number(self.top_p, "SamplingParams.top_p", gt=0, le=1, error=error)
        self.top_k = checks.integer(self.top_k, "SamplingParams.top_k (0 or -1 disables it)", ge=-1, error=error)
        self.min_p = checks.number(self.min_p, "SamplingParams.min_p", ge=0, le=1, error=error)
        self.seed = checks.optional(checks.integer, self.seed, "SamplingParams.seed", ge=0, le=2**32 - 1, error=error)
        self.max_tokens = checks.optional(checks.integer, self.max_tokens, "SamplingParams.max_tokens", ge=1,
                                          error=error)
        self.logprobs = checks.optional(checks.integer, self.logprobs, "SamplingParams.logprobs", ge=0, error=error)
        self.ignore_eos = checks.boolean(self.ignore_eos, "SamplingParams.ignore_eos", error=error)
        self.skip_special_tokens = checks.boolean(self.skip_special_tokens, "SamplingParams.skip_special_tokens",
                                                  error=error)
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and (not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop)):
            raise error(f"SamplingParams.stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = None if stop is None else list(stop)
        if self.stop_token_ids is not None:
            self.stop_token_ids = list(checks.integer_list(self.stop_token_ids, "SamplingParams.stop_token_ids", ge=0,
                                                           error=error))

    def check_vocabulary(self, vocab_size: int) -> None:
        """The checks that need the model: ``top_k`` and ``stop_token_ids`` within its vocabulary."""
        if self.top_k > vocab_size:
            raise InvalidRequestError(f"SamplingParams.top_k must be at most the vocabulary size ({vocab_size}), "
                                      f"or 0 / -1 to disable it; got {self.top_k}")
        bad = [t for t in self.stop_token_ids or () if t >= vocab_size]
        if bad:
            raise InvalidRequestError(f"SamplingParams.stop_token_ids outside the vocabulary [0, {vocab_size}): {bad}")


@struct.dataclass
class SamplingBatch:
    """Per-sequence sampling state for one device step; padding rows are greedy and ignored."""

    temperature: jax.Array  # [S] float32
    top_k: jax.Array  # [S] int32, 0 = off
    top_p: jax.Array  # [S] float32
    min_p: jax.Array  # [S] float32
    key_data: jax.Array  # [S, 2] uint32: raw threefry keys from each request's seed
    counters: jax.Array  # [S] int32: index of the token being sampled within its request's output
    wants_logprobs: jax.Array  # [S] bool


def seed_key_data(seed: int) -> np.ndarray:
    """Raw key of ``jax.random.PRNGKey(seed)`` computed on the host (no device op, no compile)."""
    return np.array([0, seed & 0xFFFFFFFF], np.uint32)


def _filter_logits(x, top_k, top_p, min_p):
    """Masks (to -inf) the logits that top-k, top-p and min-p remove. x: [S, V] temperature-scaled."""
    vocab = x.shape[-1]
    sorted_x = -jnp.sort(-x, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k <= 0, vocab, jnp.minimum(top_k, vocab))[:, None]
    in_top_k = rank < k
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_x, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_top_k & (mass_before < top_p[:, None])  # rank 0 is always kept
    num_kept = jnp.sum(keep, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(sorted_x, num_kept - 1, axis=-1)
    # min-p keeps p_i >= min_p * p_max, i.e. x_i >= x_max + log(min_p), whatever renormalisation came before.
    min_p_threshold = jnp.where(min_p[:, None] > 0, sorted_x[:, :1] + jnp.log(jnp.maximum(min_p[:, None], 1e-30)), -jnp.inf)
    return jnp.where((x >= threshold) & (x >= min_p_threshold), x, -jnp.inf)


def sample(logits, batch: SamplingBatch, num_logprobs: int | None = None, all_greedy: bool = False):
    """logits [S, V] float32 -> (tokens [S] int32, logprobs or None).

    ``logprobs`` (unless ``num_logprobs`` is None) is ``(sampled [S], top_ids [S, N], top_values [S, N])``
    from the log-softmax of the raw logits (before temperature and filters); zeros when no row
    asked for them. The filters, the random draw and the logprobs each run only when some row of
    the batch needs them (``lax.cond``). The ``cond``s still cost a step time, the filters' one a
    trip through the host (it holds CUB's sort, which a CUDA graph cannot). ``all_greedy`` (static)
    promises that every row is greedy: the tokens are then the argmax alone, with no ``cond`` but
    the logprobs' one, which XLA keeps in the graph. A row whose logits are not finite gets
    ``NONFINITE_TOKEN`` (its logprobs are meaningless).
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    tokens = greedy if all_greedy else _draw(logits, greedy, batch)
    logprobs = _logprobs(logits, tokens, batch, num_logprobs)
    # The row's largest logit, read at its argmax (which is the first NaN where there is one): not
    # finite for a NaN, a +Inf or an all -Inf row; a single -Inf logit is a probability of 0.
    finite = jnp.isfinite(jnp.take_along_axis(logits, greedy[:, None], axis=-1)[:, 0])
    return jnp.where(finite, tokens, NONFINITE_TOKEN), logprobs


def _draw(logits, greedy, batch: SamplingBatch):
    """Each sampling row's draw from its filtered, temperature-scaled logits; ``greedy`` elsewhere."""
    temperature = jnp.where(batch.temperature > 0, batch.temperature, 1.0)
    scaled = logits / temperature[:, None]
    needs_filter = jnp.any((batch.top_k > 0) | (batch.top_p < 1) | (batch.min_p > 0))
    scaled = jax.lax.cond(needs_filter, _filter_logits, lambda x, *_: x, scaled, batch.top_k, batch.top_p, batch.min_p)

    def draw(key_data, counter, row):
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data), counter)
        return jax.random.categorical(key, row)

    drawn = jax.lax.cond(
        jnp.any(batch.temperature > 0),
        lambda x: jax.vmap(draw)(batch.key_data, batch.counters, x).astype(jnp.int32),
        lambda x: greedy,
        scaled,
    )
    return jnp.where(batch.temperature > 0, drawn, greedy)


def _logprobs(logits, tokens, batch: SamplingBatch, num_logprobs: int | None):
    """``(sampled, top_ids, top_values)`` as ``sample`` documents them (top arrays of width
    ``num_logprobs``, which may be 0), or None when ``num_logprobs`` is None."""
    if num_logprobs is None:
        return None

    def logprobs(logits):
        logp = jax.nn.log_softmax(logits, axis=-1)
        sampled = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
        if num_logprobs == 0:
            return sampled, jnp.zeros((logits.shape[0], 0), jnp.int32), jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_values, top_ids = jax.lax.top_k(logp, num_logprobs)
        return sampled, top_ids.astype(jnp.int32), top_values

    def none(logits):
        rows = logits.shape[0]
        return (jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, num_logprobs), jnp.int32),
                jnp.zeros((rows, num_logprobs), jnp.float32))

    return jax.lax.cond(jnp.any(batch.wants_logprobs), logprobs, none, logits)
