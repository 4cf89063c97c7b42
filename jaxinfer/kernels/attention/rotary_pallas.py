"""q/k RMSNorm, RoPE and the KV-cache write in one Pallas kernel (Triton lowering).

Same semantics as ``reference.rotary_cache_write``. Between the projections and attention, XLA makes
this step about seven small kernels per layer (q norm, k norm, two RoPE concatenations, the v
select, two cache updates), each a launch of its own: a large share of a one-token decode step.
Here one program per token loads its q/k/v heads, normalises them per head in float32, rotates the
first ``rotary_dim`` dims (the ``rotate_half`` partner of each column is a second, gathered load of
the same row, which hits L1), writes the rotated q and stores k and v straight into their cache slot
(the caches are aliased in place).

Below ``SPLIT_HEADS_BELOW`` tokens a program takes one (token, KV head) pair instead: its k/v head
and the q heads that share it. At a decode step's few tokens the programs then fill more of the GPU
and each one's chain of loads and reductions is shorter; at 8192 tokens one program per token was
the faster (both measured: docs/performance.md, "q/k norm, RoPE and cache write kernel").

Power-of-two head counts and head dims only (Triton blocks); any other shape runs the reference.
At a decode step the decode attention kernel does this work itself (``decode_pallas``'s fused form,
through ``RotaryColumns`` and ``norm_rotate``); this kernel serves prefill and mixed steps.

An fp8 cache (``kv_cache_dtype="fp8"``) is written as the reference writes it: k and v rounded to
their own dtype, then ``clip(x / scale, -448, 448)`` in e4m3 (``jaxinfer.cache.fp8``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.cache import fp8

from jaxinfer.kernels.attention import reference


SPLIT_HEADS_BELOW = 256  # tokens: fewer take one program per (token, KV head), more one per token


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def shapes_fit(num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int) -> bool:
    """Whether the kernel takes these heads (Triton blocks are powers of two)."""
    return _is_pow2(num_heads) and _is_pow2(num_kv_heads) and _is_pow2(head_dim) and rotary_dim % 2 == 0


class RotaryColumns:
    """Per-column index vectors of a head's RoPE: which columns rotate, each one's ``rotate_half``
    partner, and its column of the cos/sin tables (clamped; loads mask the non-rotary ones)."""

    def __init__(self, head_dim: int, rotary_dim: int):
        self.col = lax.broadcasted_iota(jnp.int32, (head_dim,), 0)
        self.in_rotary = self.col < rotary_dim
        half = rotary_dim // 2
        self.first_half = self.col < half
        self.partner = jnp.where(self.first_half, self.col + half, jnp.where(self.in_rotary, self.col - half, self.col))
        self.table_col = jnp.minimum(self.col, rotary_dim - 1)

    def table_row(self, ref, token):
        """Row ``token`` of a cos/sin table [T, rotary_dim] as [head_dim] (0 past ``rotary_dim``)."""
        return plgpu.load(ref.at[token, self.table_col], mask=self.in_rotary, other=0.0)


def norm_rotate(x, x_partner, cos, sin, columns: RotaryColumns, norm_ref=None, eps: float = 0.0):
    """Heads ``x`` [heads, d] (and the same heads' values at the partner columns) -> the optional
    per-head RMSNorm (weights ``norm_ref`` [d], as ``reference.rms_norm``: the row's scale applies to
    both loads) and RoPE, as ``reference.rotary_cache_write`` computes them."""
    if norm_ref is not None:
        x32 = x.astype(jnp.float32)
        scale = lax.rsqrt((x32 * x32).sum(axis=1) / x.shape[1] + eps)[:, None]
        weight = norm_ref[...]
        weight_partner = plgpu.load(norm_ref.at[columns.partner])
        x = weight[None, :] * (x32 * scale).astype(x.dtype)
        x_partner = weight_partner[None, :] * (x_partner.astype(jnp.float32) * scale).astype(x_partner.dtype)
    c, s = cos.astype(x.dtype)[None, :], sin.astype(x.dtype)[None, :]
    rotated = x * c + jnp.where(columns.first_half[None, :], -x_partner, x_partner) * s
    return jnp.where(columns.in_rotary[None, :], rotated, x)


def _kernel(slot_ref, q_ref, k_ref, v_ref, cos_ref, sin_ref, *rest, has_norm: bool, eps: float, rotary_dim: int,
            page_size: int, num_slots: int, fp8_cache: bool = False):
    """``rest``: [q_norm, k_norm,] [kv_scales ([k_scale, v_scale] of an fp8 cache),] the caches in,
    then the outputs: q, the caches."""
    q_norm_ref = k_norm_ref = kv_scale_ref = None
    if has_norm:
        q_norm_ref, k_norm_ref, *rest = rest
    if fp8_cache:
        kv_scale_ref, *rest = rest
    _, _, q_out_ref, k_cache_ref, v_cache_ref = rest
    t, g = pl.program_id(0), pl.program_id(1)
    columns = RotaryColumns(q_ref.shape[-1], rotary_dim)
    cos, sin = columns.table_row(cos_ref, t), columns.table_row(sin_ref, t)

    def rotate(x_ref, norm_ref):
        shape = x_ref.shape
        x_partner = plgpu.load(x_ref.at[lax.broadcasted_iota(jnp.int32, shape, 0),
                                        jnp.broadcast_to(columns.partner, shape)])
        return norm_rotate(x_ref[...], x_partner, cos, sin, columns, norm_ref, eps)

    q_out_ref[...] = rotate(q_ref, q_norm_ref).astype(q_out_ref.dtype)
    k = rotate(k_ref, k_norm_ref)
    slot = slot_ref[t]

    def stored(x, cache_ref, which: int):
        if not fp8_cache:
            return x.astype(cache_ref.dtype)
        x = x.astype(k_ref.dtype if which == 0 else v_ref.dtype).astype(jnp.float32) / kv_scale_ref[which]
        return jnp.clip(x, -fp8.FP8_MAX, fp8.FP8_MAX).astype(cache_ref.dtype)

    @pl.when((slot >= 0) & (slot < num_slots))
    def _():
        page, offset = slot // page_size, slot % page_size
        kv_heads = pl.ds(g * k_ref.shape[0], k_ref.shape[0])  # this program's KV heads
        k_cache_ref[kv_heads, page, offset, :] = stored(k, k_cache_ref, 0)
        v_cache_ref[kv_heads, page, offset, :] = stored(v_ref[...], v_cache_ref, 1)


@functools.partial(jax.jit, static_argnames=("norm_eps", "interpret"), donate_argnums=(5, 6))
def rotary_cache_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, *, q_norm=None, k_norm=None,
                       norm_eps: float = 1e-6, k_scale=None, v_scale=None, interpret: bool = False):
    """q [T, heads, d], k/v [T, kv_heads, d], cos/sin [T, rotary_dim] float32, caches [kv_heads, pages,
    page_size, d] (updated in place), slot_mapping [T] -> (q, k_cache, v_cache); see the reference.
    fp8 caches come with their float32 scales ``k_scale`` / ``v_scale``."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_cache.shape
    rotary_dim = cos.shape[-1]
    reference.check_qk_norm(q_norm, k_norm)
    fp8.check_scale(k_cache, k_scale, "K")
    fp8.check_scale(v_cache, v_scale, "V")
    if not shapes_fit(num_heads, num_kv_heads, head_dim, rotary_dim) or num_tokens == 0:
        return reference.rotary_cache_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_norm=q_norm,
                                            k_norm=k_norm, norm_eps=norm_eps, k_scale=k_scale, v_scale=v_scale)
    has_norm = q_norm is not None
    q_out_dtype = jnp.result_type(q_norm, q) if has_norm else q.dtype  # the reference's: weight * normed q
    kv_per_program = 1 if num_tokens < SPLIT_HEADS_BELOW else num_kv_heads
    whole = lambda x: pl.BlockSpec(x.shape, lambda t, g: (0,) * x.ndim)  # noqa: E731
    # A program's heads: kv_per_program KV heads and their q heads (heads of one KV head are adjacent).
    heads = lambda x: pl.BlockSpec((None, x.shape[1] * kv_per_program // num_kv_heads, head_dim),  # noqa: E731
                                   lambda t, g: (t, g, 0))
    inputs = [slot_mapping.astype(jnp.int32), q, k, v, cos.astype(jnp.float32), sin.astype(jnp.float32)]
    in_specs = [whole(inputs[0]), heads(q), heads(k), heads(v), whole(inputs[4]), whole(inputs[5])]
    if has_norm:
        inputs += [q_norm, k_norm]
        in_specs += [whole(q_norm), whole(k_norm)]
    fp8_cache = k_scale is not None
    if fp8_cache:
        inputs.append(jnp.stack([k_scale, v_scale]).astype(jnp.float32))
        in_specs.append(whole(inputs[-1]))
    cache_index = len(inputs)
    inputs += [k_cache, v_cache]
    in_specs += [whole(k_cache), whole(v_cache)]
    kernel = functools.partial(_kernel, has_norm=has_norm, eps=float(norm_eps), rotary_dim=rotary_dim,
                               page_size=page_size, num_slots=num_pages * page_size, fp8_cache=fp8_cache)
    return tuple(pl.pallas_call(
        kernel,
        grid=(num_tokens, num_kv_heads // kv_per_program),
        in_specs=in_specs,
        out_specs=[heads(q), whole(k_cache), whole(v_cache)],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q_out_dtype), jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
        input_output_aliases={cache_index: 1, cache_index + 1: 2},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="rotary_cache_write",
    )(*inputs))


__all__ = ["rotary_cache_write"]
