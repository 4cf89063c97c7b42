"""Type and range checks for user-facing values (config fields, engine options, sampling parameters).

Each check returns the value as a plain Python ``int`` / ``float`` / ``bool`` or raises ``error`` (a
``JaxInferError`` subclass) with a message that names the field, the value and what is allowed.
Python and numpy integers count as integers; bools never count as numbers, and strings never as
either (no silent coercion).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jaxinfer.errors import ConfigError


def is_integer(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_number(value: Any) -> bool:
    return is_integer(value) or isinstance(value, (float, np.floating))


def _bounds(ge=None, gt=None, le=None, lt=None) -> str:
    parts = []
    if ge is not None:
        parts.append(f">= {ge}")
    if gt is not None:
        parts.append(f"> {gt}")
    if le is not None:
        parts.append(f"<= {le}")
    if lt is not None:
        parts.append(f"< {lt}")
    return " and ".join(parts)


def integer(value: Any, name: str, *, ge: int | None = None, le: int | None = None, error=ConfigError) -> int:
    """``value`` as an int, if it is an integer within ``[ge, le]``."""
    if not is_integer(value) or (ge is not None and value < ge) or (le is not None and value > le):
        allowed = " ".join(filter(None, ["an integer", _bounds(ge=ge, le=le)]))
        raise error(f"{name} must be {allowed}, got {value!r}")
    return int(value)


def number(value: Any, name: str, *, ge=None, gt=None, le=None, lt=None, error=ConfigError) -> float:
    """``value`` as a float, if it is a finite number within the given bounds."""
    ok = is_number(value) and math.isfinite(value)
    if ok:
        ok = not ((ge is not None and value < ge) or (gt is not None and value <= gt)
                  or (le is not None and value > le) or (lt is not None and value >= lt))
    if not ok:
        allowed = " ".join(filter(None, ["a finite number", _bounds(ge, gt, le, lt)]))
        raise error(f"{name} must be {allowed}, got {value!r}")
    return float(value)


def boolean(value: Any, name: str, *, error=ConfigError) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise error(f"{name} must be true or false, got {value!r}")
    return bool(value)


def optional(check, value: Any, name: str, **bounds):
    """``check(value, name, **bounds)``, or None when ``value`` is None."""
    return None if value is None else check(value, name, **bounds)


def integer_list(value: Any, name: str, *, ge: int | None = None, le: int | None = None,
                 error=ConfigError) -> tuple[int, ...]:
    """A list (or tuple) of integers within ``[ge, le]``, as a tuple."""
    if not isinstance(value, (list, tuple)):
        raise error(f"{name} must be a list of integers, got {value!r}")
    return tuple(integer(v, f"{name}[{i}]", ge=ge, le=le, error=error) for i, v in enumerate(value))
