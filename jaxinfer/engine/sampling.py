"""Sampling parameters (host side) and the jitted sampler (device side).

Order of the filters, as in HF's generation warpers: temperature -> top-k -> top-p -> min-p; then
one draw. ``temperature == 0`` is greedy (argmax of the raw logits). Each request draws with the key
``fold_in(PRNGKey(seed), n)`` for its n-th generated token, so its samples do not depend on which
other requests share the batch, nor on preemption and recompute.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.errors import InvalidRequestError


@dataclasses.dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until the model length
    stop: str | list[str] | None = None  # stop strings; not included in the output
    stop_token_ids: list[int] | None = None  # also stop on these (the token is kept in token_ids)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token
    skip_special_tokens: bool = True

    def __post_init__(self):
        def bad(what):
            raise InvalidRequestError(f"invalid SamplingParams: {what}")

        if not isinstance(self.temperature, (int, float)) or not np.isfinite(self.temperature) or self.temperature < 0:
            bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be an integer >= 0 (0 or -1 disables it), got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be a positive integer or None, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**32):
            bad(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad(f"logprobs must be a non-negative integer, got {self.logprobs!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and (not all(isinstance(s, str) and s for s in self.stop)):
            bad(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if self.stop_token_ids is not None and not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")


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


def sample(logits, batch: SamplingBatch, num_logprobs: int = 0, all_greedy: bool = False):
    """logits [S, V] float32 -> (tokens [S] int32, logprobs or None).

    ``logprobs`` (when ``num_logprobs > 0``) is ``(sampled [S], top_ids [S, N], top_values [S, N])``
    from the log-softmax of the raw logits (before temperature and filters); zeros when no row
    asked for them. The filters, the random draw and the logprobs each run only when some row of
    the batch needs them (``lax.cond``). The ``cond``s still cost a step time, the filters' one a
    trip through the host (it holds CUB's sort, which a CUDA graph cannot). ``all_greedy`` (static)
    promises that every row is greedy: the tokens are then the argmax alone, with no ``cond`` but
    the logprobs' one, which XLA keeps in the graph.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if all_greedy:
        return greedy, _logprobs(logits, greedy, batch, num_logprobs)
    tokens = _draw(logits, greedy, batch)
    return tokens, _logprobs(logits, tokens, batch, num_logprobs)


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


def _logprobs(logits, tokens, batch: SamplingBatch, num_logprobs: int):
    """``(sampled, top_ids, top_values)`` as ``sample`` documents them, or None when ``num_logprobs <= 0``."""
    if num_logprobs <= 0:
        return None

    def logprobs(logits):
        logp = jax.nn.log_softmax(logits, axis=-1)
        top_values, top_ids = jax.lax.top_k(logp, num_logprobs)
        sampled = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
        return sampled, top_ids.astype(jnp.int32), top_values

    def none(logits):
        rows = logits.shape[0]
        return (jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, num_logprobs), jnp.int32),
                jnp.zeros((rows, num_logprobs), jnp.float32))

    return jax.lax.cond(jnp.any(batch.wants_logprobs), logprobs, none, logits)
