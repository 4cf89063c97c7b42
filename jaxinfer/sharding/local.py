"""The local view layers compute in: inside the sharded forward each device holds its pieces of the
parameters and caches, and layers ask here how big their piece is and when to combine pieces.

Outside it (a model's ``init``, ``jax.eval_shape``), everything is whole: ``ways`` is 1, ``local``
returns its argument, and the collectives return their input. So a layer is written once, against
local sizes, and the same code declares the global parameters.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.errors import ConfigError
from jaxinfer.sharding.plan import FIELDS, ShardingPlan

_active: contextvars.ContextVar[ShardingPlan | None] = contextvars.ContextVar("sharding_plan", default=None)


def active() -> ShardingPlan | None:
    """The plan of the sharded forward being traced, or None (a whole-array trace)."""
    return _active.get()


@contextlib.contextmanager
def local_view(plan: ShardingPlan) -> Iterator[None]:
    token = _active.set(plan)
    try:
        yield
    finally:
        _active.reset(token)


def ways(logical: str | None) -> int:
    """How many pieces ``logical`` is split into here (1 outside the sharded forward)."""
    plan = active()
    return plan.ways(logical) if plan is not None else 1


def local(size: int, logical: str | None) -> int:
    """This device's share of a dimension of ``size`` along ``logical``; ``ConfigError`` where it does
    not split evenly (a model's sharded forward is traced before its weights are read, so a count
    no layer can split is refused then)."""
    pieces = ways(logical)
    if size % pieces:
        raise ConfigError(f"a layer's {size} {logical} ({FIELDS.get(logical, logical)}) do not split over {pieces} "
                          f"devices: choose partition sizes that divide them")
    return size // pieces


def mesh_axes(logical: str) -> tuple[str, ...]:
    """The mesh axes ``logical`` is split over here (``()`` outside the sharded forward)."""
    plan = active()
    return plan.mesh_axes(logical) if plan is not None else ()


def index(logical: str):
    """This device's piece number along ``logical`` (0 where it is whole), an int32 scalar."""
    axes = mesh_axes(logical)
    if not axes:
        return jnp.int32(0)
    return jax.lax.axis_index(axes).astype(jnp.int32)


def sum_over(x, logical: str):
    """The sum of ``x`` over the pieces of ``logical`` (a row-parallel projection's partial outputs)."""
    axes = mesh_axes(logical)
    return jax.lax.psum(x, axes) if axes else x


def gather(x, logical: str, axis: int = -1):
    """The pieces of ``x`` along ``logical`` joined on ``axis`` (vocabulary-parallel logits)."""
    axes = mesh_axes(logical)
    if not axes:
        return x
    return jax.lax.all_gather(x, axes, axis=axis % x.ndim, tiled=True)


def param(module: nn.Module, name: str, init, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype):
    """``module.param`` of an array of global ``shape`` whose dimensions are the logical ``axes``: the
    local piece inside the sharded forward; the whole array, annotated with its axes, in ``init``."""
    if len(axes) != len(shape):
        raise ValueError(f"{name}: {len(axes)} logical axes for a shape of {len(shape)} dims")
    local_shape = tuple(local(size, logical) for size, logical in zip(shape, axes))
    return module.param(name, nn.with_logical_partitioning(init, axes), local_shape, dtype)
