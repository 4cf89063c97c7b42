"""Rotary position embeddings with every scaling type of HF's ``modeling_rope_utils``.

``default``, ``linear``, ``llama3`` and ``yarn`` have one set of inverse frequencies, computed once on
the host in float32 exactly as HF does. ``dynamic`` (NTK) and ``longrope`` change their frequencies
with the sequence length: HF recomputes them per forward call from ``max(position_ids) + 1``. Here each
token uses its own sequence's length in the current step (``seq_len_of_token``), which is what HF
computes for a single sequence, in prefill and in every decode step.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from jaxinfer.config import RopeConfig


def _default_inv_freq(base: float, dim: int) -> np.ndarray:
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / (np.float32(base) ** exponents)).astype(np.float32)


def _llama3_inv_freq(rope: RopeConfig, dim: int) -> np.ndarray:
    inv_freq = _default_inv_freq(rope.theta, dim)
    old_context = rope.original_max_position_embeddings
    low_wavelen = old_context / rope.low_freq_factor
    high_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    factor, base, orig = rope.factor, rope.theta, rope.original_max_position_embeddings
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1

    def correction_dim(num_rotations):
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent singularity
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq.astype(np.float32), float(attention_factor)


@dataclasses.dataclass(frozen=True)
class RotaryEmbedding:
    """cos/sin tables for ``rotate_half`` RoPE over the first ``rotary_dim`` dims of each head."""

    rope: RopeConfig
    head_dim: int
    max_position_embeddings: int

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def attention_scaling(self) -> float:
        """Multiplier applied to cos and sin (yarn / longrope), 1 otherwise."""
        rope = self.rope
        if rope.rope_type == "yarn":
            return _yarn_inv_freq(rope, self.rotary_dim)[1]
        if rope.rope_type == "longrope":
            if rope.attention_factor is not None:
                return float(rope.attention_factor)
            orig = rope.original_max_position_embeddings
            factor = rope.factor if rope.factor is not None else self.max_position_embeddings / orig
            return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        return 1.0

    def static_inv_freq(self) -> np.ndarray | None:
        """Frequencies that do not depend on the sequence length; None for dynamic / longrope."""
        rope, dim = self.rope, self.rotary_dim
        if rope.rope_type == "default":
            return _default_inv_freq(rope.theta, dim)
        if rope.rope_type == "linear":
            return (_default_inv_freq(rope.theta, dim) / np.float32(rope.factor)).astype(np.float32)
        if rope.rope_type == "llama3":
            return _llama3_inv_freq(rope, dim)
        if rope.rope_type == "yarn":
            return _yarn_inv_freq(rope, dim)[0]
        return None

    def _length_dependent_inv_freq(self, seq_len):
        """[T, dim/2] frequencies for dynamic NTK / longrope, from each token's sequence length."""
        rope, dim = self.rope, self.rotary_dim
        exponents = jnp.asarray(np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim))
        seq_len = seq_len.astype(jnp.float32)[:, None]
        if rope.rope_type == "dynamic":
            max_pos = float(self.max_position_embeddings)
            seq_len = jnp.maximum(seq_len, max_pos)
            base = rope.theta * ((rope.factor * seq_len / max_pos) - (rope.factor - 1)) ** (dim / (dim - 2))
            return 1.0 / (base**exponents)
        # longrope: long factors once the sequence outgrows the pretraining length.
        long_factor = jnp.asarray(rope.long_factor, jnp.float32)
        short_factor = jnp.asarray(rope.short_factor, jnp.float32)
        ext = jnp.where(seq_len > rope.original_max_position_embeddings, long_factor, short_factor)
        return 1.0 / (ext * jnp.float32(rope.theta) ** exponents)

    def cos_sin(self, positions, seq_len_of_token):
        """cos, sin of shape [T, rotary_dim] (float32; HF's ``cat(freqs, freqs)`` layout)."""
        inv_freq = self.static_inv_freq()
        if inv_freq is None:
            freqs = positions.astype(jnp.float32)[:, None] * self._length_dependent_inv_freq(seq_len_of_token)
        else:
            freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        scale = self.attention_scaling
        return jnp.cos(emb) * scale, jnp.sin(emb) * scale
