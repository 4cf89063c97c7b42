"""Chat templates rendered exactly as transformers renders them, in a sandbox that bounds memory and time.

A checkpoint's chat template is code from the checkpoint. transformers renders it in jinja2's
``ImmutableSandboxedEnvironment``, which keeps it from Python's internals but not from asking for
``'a' * 4000000000`` or looping ``range(100000)`` inside ``range(100000)``. Here the same template, with
the same environment options, extensions, filters, globals and variables as
``tokenizer.apply_chat_template``, renders in a subclass of that sandbox where nothing it does can take
more than the limits below:

* every operator that can grow a value (``+ * ** %`` and ``~``), every filter, call and container
  literal is checked against the size limits *before* it runs where its inputs tell its size (widths
  and counts given to ``center``, ``indent``, ``wordwrap``, ``format``, ``str.ljust``, ``join`` ...), and
  its result after: strings (``MAX_STRING_CHARS``), containers counted as trees, an item held twice
  counted twice (``MAX_ITEMS``, and the text they print as), integers (``MAX_INT_BITS``);
* what it makes is charged to a per-render budget (``MAX_ALLOCATED_BYTES``), so that many values, each
  within the limits, cannot add up;
* every loop step, call, filter and piece of output checks a deadline (``TIME_LIMIT_S`` plus a little
  per item and character of the conversation), and the output is streamed and counted
  (``MAX_OUTPUT_CHARS``); template text collected inside macros and blocks is counted too.

To do this the template's syntax tree is rewritten before it is compiled (loops, output, ``~``,
literals and slices go through checks); the rendered text is unchanged. A template over a limit is
refused with ``ChatTemplateLimitError`` (an ``InvalidRequestError``) naming what it asked for, the
limit and the template line. The limits are far above what real templates need: a rendered prompt is
a few MB of text at most, and real templates render in milliseconds.
"""

from __future__ import annotations

import collections
import contextvars
import functools
import inspect
import itertools
import json
import re
import sys
import time
import types
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.filters
from jinja2 import nodes
from jinja2.runtime import LoopContext, markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter
from jinja2.utils import Namespace, generate_lorem_ipsum, pass_context, pass_environment, pass_eval_context
from jinja2.visitor import NodeTransformer

from jaxinfer.errors import InvalidRequestError

# ---- limits ---------------------------------------------------------------------------------------

# Any one string a template makes, or the text a value prints as: 4x a million-token prompt.
MAX_STRING_CHARS = 16 * 2**20
# The rendered prompt: the same as a string (the prompt is one).
MAX_OUTPUT_CHARS = MAX_STRING_CHARS
# Items in one container, nested ones counted: a 25,000-message conversation (long agent traces have
# ~10^3-10^4 messages); keeps one sort, comparison or filter pass over a list well under a second.
MAX_ITEMS = 2**17
# Integers: Python itself refuses to print one over 4300 digits (~14k bits).
MAX_INT_BITS = 2**16
# Bytes of all the values one render makes, together: 16x a 16M-character prompt.
MAX_ALLOCATED_BYTES = 2**28
# Wall-clock time of one render, plus the allowances below: real templates take milliseconds.
TIME_LIMIT_S = 0.5
# Per item of what the template is given (a message is ~5: the dict, keys, values): real templates
# take ~10 us per item, so long conversations are not refused for time.
TIME_PER_INPUT_ITEM_S = 50e-6
# Per character of what the template is given: string operations run at ~1 ns per character.
TIME_PER_INPUT_CHAR_S = 20e-9
# The template's source: ~8x the largest published chat templates; the densest template this long
# compiles in ~3 s, once (compiled templates are cached).
MAX_TEMPLATE_CHARS = 2**18


class ChatTemplateLimitError(InvalidRequestError):
    """A chat template asked for more memory or time than the bounds of ``jaxinfer.chat_template`` allow."""


class _Refused(Exception):
    """Raised inside a render when a bound is hit; not a ValueError or TypeError, so no code between the
    template and us mistakes it for an ordinary failure. Turned into ``ChatTemplateLimitError``."""


# ---- the state of one render ------------------------------------------------------------------------


class _Render:
    """The deadline, the bytes charged so far, and the measured containers (kept alive, so their ids
    stay theirs) of one render."""

    __slots__ = ("seconds", "deadline", "budget", "spent", "cache", "refused", "steps")

    def __init__(self, budget: float = float("inf")):
        self.seconds = self.deadline = float("inf")
        self.budget = budget
        self.spent = 0
        self.cache: dict[int, tuple[object, tuple[int, int, int]]] = {}
        self.refused: str | None = None
        self.steps = 0

    def refuse(self, message: str):
        if self.refused is None:
            self.refused = message
        raise _Refused(message)

    def tick(self) -> None:
        if self.refused is not None:
            raise _Refused(self.refused)
        if time.perf_counter() > self.deadline:
            self.refuse(f"the template ran past its time limit of {self.seconds:.2f} s (TIME_LIMIT_S = "
                        f"{TIME_LIMIT_S} s, plus TIME_PER_INPUT_ITEM_S and TIME_PER_INPUT_CHAR_S for what it is given)")

    def charge(self, size: int, what: str) -> None:
        self.spent += size
        if self.spent > self.budget:
            self.refuse(f"{what} brought the values the template made to {self.spent:,} bytes in all, over the "
                        f"limit of {MAX_ALLOCATED_BYTES:,} (MAX_ALLOCATED_BYTES)")


_current: contextvars.ContextVar[_Render | None] = contextvars.ContextVar("jaxinfer_chat_render", default=None)


def _state() -> _Render:
    """The running render's state, ticked; outside a render (jinja folding constants while compiling) a
    throwaway one without deadline or budget, so the size limits still hold."""
    state = _current.get()
    if state is None:
        return _Render()
    if state.refused is not None or time.perf_counter() > state.deadline:
        state.tick()
    return state


def _pulse() -> None:
    """The deadline, checked every 32nd call: for the cheap, frequent steps (attribute lookups, tests)."""
    state = _current.get()
    if state is not None:
        state.steps += 1
        if not state.steps & 31:
            state.tick()


# ---- sizes ------------------------------------------------------------------------------------------


_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))
_CONTAINERS = (list, tuple, dict, set, frozenset, Namespace, *_VIEWS)
_CACHEABLE = (list, tuple, dict, set, frozenset)  # what a template cannot change (namespaces it can)
_SMALL = (1, 8, 0)
_SMALL_TYPES = frozenset({bool, float, type(None)})
_SCALAR_TYPES = _SMALL_TYPES | {str, int}
_SEQUENCES = (list, tuple, set, frozenset)


def _leaf(obj) -> tuple[int, int, int] | None:
    """(items, characters printed, depth) of a value that holds no others; None for a container."""
    kind = type(obj)
    if kind is str:
        return 1, len(obj) + 2, 0
    if kind is int:
        return 1, obj.bit_length() * 3 // 10 + 2, 0
    if kind in _SMALL_TYPES:
        return _SMALL
    if isinstance(obj, _CONTAINERS):
        return None
    if isinstance(obj, str):
        return 1, len(obj) + 2, 0
    if isinstance(obj, (bytes, bytearray)):
        return 1, len(obj) + 3, 0
    if isinstance(obj, int) and not isinstance(obj, bool):
        return 1, obj.bit_length() * 3 // 10 + 2, 0
    return _SMALL


def _children(obj):
    if isinstance(obj, dict):
        return itertools.chain(obj.keys(), obj.values())
    if isinstance(obj, Namespace):
        attrs = obj._Namespace__attrs
        return itertools.chain(attrs.keys(), attrs.values())
    if isinstance(obj, _VIEWS[2]):
        return itertools.chain.from_iterable(obj)
    return obj


def _scalar_chars(values) -> int | None:
    """Characters ``values`` print as, if all are strings or numbers (or None); else None."""
    chars = 0
    for x in values:
        kind = type(x)
        if kind is str:
            chars += len(x) + 4
        elif kind in _SMALL_TYPES:
            chars += 10
        elif kind is int:
            chars += x.bit_length() * 3 // 10 + 4
        else:
            return None
    return chars


def _flat(node) -> tuple[int, int, int] | None:
    """The measure of a list, tuple or set of only strings and numbers, or of a small dict of such keys
    and values (e.g. a message), without walking it item by item as a tree; None for anything else."""
    kind = type(node)
    if kind is dict:
        if len(node) > 16:
            return None
        keys, values = _scalar_chars(node), _scalar_chars(node.values())
        return None if keys is None or values is None else (2 * len(node) + 1, keys + values + 2, 1)
    if kind not in _SEQUENCES:
        return None
    n = len(node)
    if n <= 16:
        chars = _scalar_chars(node)
        return None if chars is None else (n + 1, chars + 2, 1)
    kinds = set(map(type, node))  # C speed
    if kinds == {str}:
        return n + 1, sum(map(len, node)) + 4 * n + 2, 1
    if kinds == {int}:
        return n + 1, sum(map(int.bit_length, node)) * 3 // 10 + 4 * n + 2, 1
    if kinds <= _SMALL_TYPES:
        return n + 1, 10 * n + 2, 1
    return None


def _measure(obj, state: _Render) -> tuple[int, int, int]:
    """(items, characters, depth) of ``obj`` as a tree: an item held twice counts twice, as printing,
    comparing or hashing it would visit it twice. The cost is one visit per distinct container (and a
    C-speed pass over each one's items); containers that cannot change (no namespace inside) are cached
    for the render. Once a part is over a limit, that part's count is returned: the whole is over too."""
    leaf = _leaf(obj)
    if leaf is not None:
        return leaf
    cache = state.cache
    hit = cache.get(id(obj))
    if hit is not None and hit[0] is obj:
        return hit[1]
    done: dict[int, tuple[tuple[int, int, int], bool]] = {}
    open_: dict[int, list] = {}  # containers expanded but not finished: the path from obj (a cycle ends there)
    stack, steps = [obj], 0
    while stack:
        node = stack[-1]
        key = id(node)
        if key in done:
            stack.pop()
            continue
        if key not in open_:
            cacheable = type(node) in _CACHEABLE
            flat = _flat(node)
            if flat is not None:  # only strings or only numbers: measured at C speed
                done[key] = (flat, cacheable)
                if cacheable:
                    cache[key] = (node, flat)
                stack.pop()
                continue
            kids = node if isinstance(node, (list, tuple)) else list(_children(node))
            if len(kids) > 64:  # a kid held n times (e.g. [x] * n) is measured once
                counts = collections.Counter(map(id, kids))
                kids = dict(zip(map(id, kids), kids)).values()
            else:
                counts = None
            items, chars, depth, pending = 1, 2, 0, []
            for kid in kids:
                n = 1 if counts is None else counts[id(kid)]
                m = _leaf(kid)
                if m is None:
                    hit = cache.get(id(kid))
                    if hit is not None and hit[0] is kid:
                        m = hit[1]
                    else:
                        m = _flat(kid)  # most kids are flat (a message): measured on the spot
                        if m is None:
                            pending.append((kid, n))
                            continue
                items += m[0] * n
                chars += (m[1] + 2) * n
                if m[2] > depth:
                    depth = m[2]
                if items > MAX_ITEMS or chars > MAX_STRING_CHARS:
                    return items, chars, depth + 1
                steps += 1
                if not steps & 4095:  # a big structure: keep to the deadline
                    state.tick()
            open_[key] = [items, chars, depth, cacheable, pending]
            new = [kid for kid, _ in pending if id(kid) not in done and id(kid) not in open_]
            if new:
                stack.extend(new)
                continue
        items, chars, depth, frozen, pending = open_.pop(key)
        for kid, n in pending:
            found = done.get(id(kid))
            if found is None:  # a namespace that holds itself: printed as {...}
                m, frozen = (1, 5, 0), False
            else:
                m, frozen = found[0], frozen and found[1]
            items += m[0] * n
            chars += (m[1] + 2) * n
            if m[2] > depth:
                depth = m[2]
        m = (items, chars, depth + 1)
        if items > MAX_ITEMS or chars > MAX_STRING_CHARS:
            return m
        done[key] = (m, frozen)
        if frozen:
            cache[key] = (node, m)
        stack.pop()
    return done[id(obj)][0]


def _limits(state: _Render, value, what: str):
    """Refuse ``value`` if it is over a size limit; charge its bytes to the render."""
    if type(value) is str or isinstance(value, (str, bytes, bytearray)):
        if len(value) > MAX_STRING_CHARS:
            state.refuse(f"{what} made a string of {len(value):,} characters, over the limit of "
                         f"{MAX_STRING_CHARS:,} (MAX_STRING_CHARS)")
    elif isinstance(value, int) and not isinstance(value, bool):
        _check_bits(state, value.bit_length(), what)
    elif _leaf(value) is None:
        items, chars, _ = _measure(value, state)
        _check_container(state, items, chars, what)
    else:
        return value
    state.charge(sys.getsizeof(value), what)
    return value


def _check_chars(state: _Render, n: int, what: str) -> None:
    if n > MAX_STRING_CHARS:
        state.refuse(f"{what} would make a string of {n:,} characters, over the limit of {MAX_STRING_CHARS:,} "
                     "(MAX_STRING_CHARS)")


def _check_width(state: _Render, width, what: str) -> None:
    if isinstance(width, int) and width > MAX_STRING_CHARS:
        state.refuse(f"{what} would pad to a width of {width:,} characters, over the limit of "
                     f"{MAX_STRING_CHARS:,} (MAX_STRING_CHARS)")


def _check_bits(state: _Render, bits: int, what: str) -> None:
    if bits > MAX_INT_BITS:
        state.refuse(f"{what} would make an integer of {bits:,} bits, over the limit of {MAX_INT_BITS:,} "
                     "(MAX_INT_BITS)")


def _check_container(state: _Render, items: int, chars: int, what: str, verb: str = "would make") -> None:
    if items > MAX_ITEMS:
        state.refuse(f"{what} {verb} a container of {items:,} items (nested ones counted), over the limit "
                     f"of {MAX_ITEMS:,} (MAX_ITEMS)")
    if chars > MAX_STRING_CHARS:
        state.refuse(f"{what} {verb} a container that prints as about {chars:,} characters, over the limit "
                     f"of {MAX_STRING_CHARS:,} (MAX_STRING_CHARS)")


def _text_size(state: _Render, value) -> int:
    """About how many characters ``str(value)`` makes."""
    if isinstance(value, str):
        return len(value)
    return _measure(value, state)[1]


def _check_args(state: _Render, args, kwargs, what: str) -> None:
    """A container handed to a filter or function may be printed by it: it must print within the limits
    (one that holds a namespace may have grown since it was made)."""
    for value in itertools.chain(args, kwargs.values()):
        if _leaf(value) is None:
            items, chars, _ = _measure(value, state)
            _check_container(state, items, chars, what, "was given")


# ---- the operations that can grow a value ---------------------------------------------------------


_OPERATOR = {op: f"the `{op}` operator" for op in ("+", "*", "**", "%")}


def _check_binop(state: _Render, op: str, left, right) -> None:
    what = _OPERATOR[op]
    sequence = (str, bytes, bytearray)
    if op == "+" and type(left) is str and type(right) is str:  # the common case, first
        if len(left) + len(right) > MAX_STRING_CHARS:
            _check_chars(state, len(left) + len(right), what)
    elif op == "*":
        if isinstance(left, int) and not isinstance(right, int):
            left, right = right, left
        if isinstance(right, int):
            count = max(right, 0)
            if isinstance(left, sequence):
                _check_chars(state, len(left) * count, what)
            elif isinstance(left, (list, tuple)):
                items, chars, _ = _measure(left, state)
                _check_container(state, (items - 1) * count + 1, (chars - 2) * count + 2, what)
            elif isinstance(left, int) and not isinstance(left, bool):
                _check_bits(state, left.bit_length() + right.bit_length(), what)
    elif op == "+":
        if isinstance(left, sequence) and isinstance(right, sequence):
            _check_chars(state, len(left) + len(right), what)
        elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
            a, b = _measure(left, state), _measure(right, state)
            _check_container(state, a[0] + b[0] - 1, a[1] + b[1] - 2, what)
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            _check_bits(state, abs(left).bit_length() * right, what)
    elif op == "%" and isinstance(left, (str, bytes)):
        _check_printf(state, left, right, what)


# %[(key)][flags][width][.precision][length]type
_PRINTF = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([a-zA-Z%])?")


def _check_printf(state: _Render, fmt, args, what: str) -> None:
    """``fmt % args``: no field padded or printed beyond the limit, and the fields together within it."""
    if isinstance(fmt, bytes):
        fmt = fmt.decode("latin-1")
    values = list(args) if isinstance(args, tuple) else [args]
    star = max((abs(v) for v in values if isinstance(v, int) and not isinstance(v, bool)), default=0)
    total = len(fmt)
    for match in _PRINTF.finditer(fmt):
        for number in match.group(1, 2):
            if number is None:
                continue
            size = star if number == "*" else (int(number) if len(number) <= 12 else MAX_STRING_CHARS + 1)
            _check_width(state, size, what)
            total += size
    total += sum(_text_size(state, v) for v in values)
    _check_chars(state, total, what)


def _digits(spec: str) -> int:
    """The largest number in a format spec (its width or precision)."""
    numbers = re.findall(r"\d+", spec)
    return max((int(n) if len(n) <= 12 else MAX_STRING_CHARS + 1 for n in numbers), default=0)


class _BoundedFormat:
    """``str.format`` in a template: each field's width and precision, what it prints, and all the
    fields together within the limits."""

    def vformat(self, format_string, args, kwargs):
        self._total = len(format_string)
        return super().vformat(format_string, args, kwargs)

    def convert_field(self, value, conversion):
        if conversion is not None:  # !r / !s / !a: the value printed
            state = _state()
            _check_chars(state, _text_size(state, value), "str.format")
        return super().convert_field(value, conversion)

    def format_field(self, value, format_spec):
        state = _state()
        width = _digits(format_spec)
        _check_width(state, width, "str.format")
        self._total += max(width, _text_size(state, value))
        _check_chars(state, self._total, "str.format")
        return super().format_field(value, format_spec)


class _BoundedFormatter(_BoundedFormat, SandboxedFormatter):
    pass


class _BoundedEscapeFormatter(_BoundedFormat, SandboxedEscapeFormatter):
    pass


def _check_str_method(state: _Render, method, args, kwargs) -> tuple:
    """Checks a call of a str / bytes method that can make a string longer than its inputs; returns
    the arguments to call it with (an iterator given to ``join`` is listed first, to be measured)."""
    s, name = method.__self__, method.__name__
    what = f"{type(s).__name__}.{name}"
    if name in ("center", "ljust", "rjust", "zfill") and args:
        _check_width(state, args[0], what)
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tabsize, int):
            _check_chars(state, len(s) + s.count("\t" if isinstance(s, str) else b"\t") * tabsize, what)
    elif name == "replace" and len(args) >= 2:
        _check_replace(state, s, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count", -1), what)
    elif name == "join" and args:
        items = args[0] if isinstance(args[0], (list, tuple)) else list(args[0])
        _check_join(state, items, s, what)
        args = (items,) + tuple(args[1:])
    elif name in ("split", "rsplit") and args and isinstance(args[0], type(s)) and args[0]:
        parts = s.count(args[0]) + 1
        maxsplit = args[1] if len(args) > 1 else kwargs.get("maxsplit", -1)
        if isinstance(maxsplit, int) and maxsplit >= 0:
            parts = min(parts, maxsplit + 1)
        _check_container(state, parts + 1, 0, what)
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, (str, bytes))), default=1)
        _check_chars(state, len(s) * max(longest, 1), what)
    return args


def _check_replace(state: _Render, s, old, new, count, what: str) -> None:
    if not (isinstance(s, (str, bytes)) and type(old) is type(s) and type(new) is type(s)):
        return
    found = len(s) + 1 if not old else s.count(old)
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    _check_chars(state, len(s) + found * (len(new) - len(old)), what)


def _check_join(state: _Render, items, separator, what: str) -> None:
    sep = len(separator) if isinstance(separator, (str, bytes)) else _text_size(state, separator)
    _check_chars(state, sum(_text_size(state, item) for item in items) + sep * max(len(items) - 1, 0), what)


# ---- filters ---------------------------------------------------------------------------------------
# Checks of the arguments of the filters whose output can outgrow their input (the value first, without
# jinja's context argument). One may return a replacement for the value (``join`` lists an iterator to
# measure it).


def _center_check(state, value, width=80):
    _check_width(state, width, "the 'center' filter")


def _indent_check(state, s, width=4, first=False, blank=False):
    if isinstance(s, str):
        step = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        _check_chars(state, len(s) + (s.count("\n") + 2) * max(step, 0), "the 'indent' filter")


def _format_check(state, value, *args, **kwargs):
    if isinstance(value, str):
        _check_printf(state, value, kwargs if kwargs else args, "the 'format' filter")


def _wordwrap_check(state, s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
    if isinstance(s, str) and isinstance(width, int) and isinstance(wrapstring, (str, type(None))):
        lines = 2 * len(s) // max(width, 1) + s.count("\n") + 2  # a line and the next hold over `width`
        _check_chars(state, len(s) + lines * (1 if wrapstring is None else len(wrapstring)),
                     "the 'wordwrap' filter")


def _join_check(state, value, d="", attribute=None):
    items = value if isinstance(value, (list, tuple)) else list(value)
    _check_join(state, items, d, "the 'join' filter")  # an attribute of an item is about its size or less
    return items


def _replace_check(state, s, old, new, count=None):
    _check_replace(state, s, old, new, -1 if count is None else count, "the 'replace' filter")


def _batch_check(state, value, linecount, fill_with=None):
    if fill_with is not None and isinstance(linecount, int) and linecount > MAX_ITEMS:
        state.refuse(f"the 'batch' filter would fill lists to {linecount:,} items, over the limit of "
                     f"{MAX_ITEMS:,} (MAX_ITEMS)")


def _slice_check(state, value, slices, fill_with=None):
    if isinstance(slices, int) and slices > MAX_ITEMS:
        state.refuse(f"the 'slice' filter would make {slices:,} lists, over the limit of {MAX_ITEMS:,} (MAX_ITEMS)")


def _list_check(state, value):
    if isinstance(value, str) and len(value) > MAX_ITEMS:
        state.refuse(f"the 'list' filter would make a list of {len(value):,} items, over the limit of "
                     f"{MAX_ITEMS:,} (MAX_ITEMS)")


def _tojson_check(state, x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    items, chars, depth = _measure(x, state)
    step = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
    _check_width(state, step, "the 'tojson' filter's indent")
    _check_chars(state, chars + items * depth * max(step, 0), "the 'tojson' filter")


def _pprint_check(state, value):
    items, chars, depth = _measure(value, state)
    _check_chars(state, chars + items * depth, "the 'pprint' filter")


_FILTER_CHECKS = {"center": _center_check, "indent": _indent_check, "format": _format_check,
                  "wordwrap": _wordwrap_check, "join": _join_check, "replace": _replace_check,
                  "batch": _batch_check, "slice": _slice_check, "list": _list_check, "tojson": _tojson_check,
                  "pprint": _pprint_check}


def _bounded_filter(name: str, func):
    """``func`` with the deadline, its check (if any) on its arguments, and the limits on its result."""
    skip = 0 if getattr(func, "jinja_pass_arg", None) is None else 1  # context / environment first
    what = f"the {name!r} filter"
    check = _FILTER_CHECKS.get(name)
    bind = inspect.signature(check).bind if check is not None else None

    @functools.wraps(func)
    def bounded(*args, **kwargs):
        state = _state()
        _check_args(state, args[skip:], kwargs, what)
        if check is not None:
            try:
                bind(state, *args[skip:], **kwargs)
            except TypeError:  # arguments the filter itself refuses: it says so
                pass
            else:
                value = check(state, *args[skip:], **kwargs)
                if value is not None:
                    args = args[:skip] + (value,) + args[skip + 1:]
        return _limits(state, func(*args, **kwargs), what)

    return bounded


def _ticking(func):
    """``func`` with the deadline checked first."""

    @functools.wraps(func)
    def ticking(*args, **kwargs):
        _pulse()
        return func(*args, **kwargs)

    return ticking


@pass_environment
def _sum(environment, iterable, attribute=None, start=0):
    """jinja's ``sum``, except that lists (or tuples) are joined in one step, not by copying the growing
    result once per item (quadratic); the same result."""
    if attribute is not None:
        iterable = map(jinja2.filters.make_attrgetter(environment, attribute), iterable)
    values = list(iterable)
    kind = type(start)
    if kind in (list, tuple) and set(map(type, values)) <= {kind}:
        state, everything = _state(), [start, *values]
        counts = collections.Counter(map(id, everything))
        items = chars = 0
        for key, v in dict(zip(map(id, everything), everything)).items():
            m = _measure(v, state)
            items += (m[0] - 1) * counts[key]
            chars += (m[1] - 2) * counts[key]
        _check_container(state, items + 1, chars + 2, "the 'sum' filter")
        return kind(itertools.chain(start, *values))
    return sum(values, start)


# ---- transformers' helpers ------------------------------------------------------------------------
# As transformers defines them (utils/chat_template_utils.py, _cached_compile_jinja_template), with
# the bounds added where they can make output.


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):  # noqa: A002 (transformers' name)
    if isinstance(format, str):  # a directive prints at most ~30 characters
        _check_chars(_state(), 16 * len(format), "strftime_now")
    return datetime.now().strftime(format)


class TemplateDict:
    # A limited `dict`, so that templates can't break out with dictionary attribute access or type-hackery.
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(Namespace):
    # Namespaces reject underscore attributes, to keep templates away from CPython internals.
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute."
            )


_LIPSUM = inspect.signature(generate_lorem_ipsum)


@functools.wraps(generate_lorem_ipsum)
def _lipsum(*args, **kwargs):
    bound = _LIPSUM.bind(*args, **kwargs)
    bound.apply_defaults()
    n, low, high = (bound.arguments[k] for k in ("n", "min", "max"))
    if all(isinstance(v, int) for v in (n, low, high)):  # words of at most ~16 characters
        _check_chars(_state(), 16 * max(n, 0) * max(low, high, 0), "lipsum")
    return generate_lorem_ipsum(*args, **kwargs)


class _GenerationBlock(jinja2.ext.Extension):
    """transformers' ``{% generation %}`` tag (its AssistantTracker): the body renders as it is; the
    assistant-mask bookkeeping is not needed here."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    @pass_eval_context
    def _generation_support(self, context, caller):
        return caller()


# ---- the sandbox ------------------------------------------------------------------------------------

# Filters that the rewrite of a template's syntax tree inserts; a template cannot name them.
_LOOP, _OUTPUT, _CONCAT, _CHECK = "jaxinfer:loop", "jaxinfer:output", "jaxinfer:concat", "jaxinfer:check"


def _loop_steps(iterable):
    """A loop's items, the deadline checked before each."""
    state = _current.get()
    for item in iterable:
        if state is not None:
            state.tick()
        yield item


@pass_context
def _loop_filter(context, iterable):
    return _loop_steps(iterable)


@pass_context
def _output_filter(context, value):
    state = _state()
    size = _text_size(state, value)
    _check_chars(state, size, "printing a value")
    state.charge(size, "printing a value")
    return value


@pass_context
def _concat_filter(context, values):
    state = _state()
    _check_chars(state, sum(_text_size(state, v) for v in values), "the `~` operator")
    join = markup_join if context.eval_ctx.autoescape else str_join
    return _limits(state, join(values), "the `~` operator")


@pass_context
def _check_filter(context, value):
    return _limits(_state(), value, "building a value")


def _name(obj) -> str:
    """What a template calls, for messages: a function's or macro's name, else the type's."""
    name = getattr(obj, "__qualname__", None)
    if not isinstance(name, str) and isinstance(obj, jinja2.runtime.Macro):
        name = obj.name
    return name[:80] if isinstance(name, str) else type(obj).__name__


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox (``ImmutableSandboxedEnvironment``) with the operators, calls and filters
    that can grow a value bounded, and a deadline; templates compiled by ``compile_chat_template`` also
    have their loops, output, ``~`` and literals checked."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def call_binop(self, context, operator, left, right):
        state = _state()
        _check_binop(state, operator, left, right)
        return _limits(state, self.binop_table[operator](left, right), _OPERATOR[operator])

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        state = _state()
        what = f"calling {_name(__obj)}"
        if isinstance(__obj, LoopContext) and args:  # the next level of a recursive loop
            args = (_loop_steps(args[0]),) + args[1:]
        elif isinstance(__obj, types.BuiltinMethodType):
            owner = getattr(__obj, "__self__", None)
            if isinstance(owner, (str, bytes, bytearray)):
                args = _check_str_method(state, __obj, args, kwargs)
            elif isinstance(owner, int) and __obj.__name__ == "to_bytes":
                length = args[0] if args else kwargs.get("length", 1)
                if isinstance(length, int):
                    _check_chars(state, length, what)
        _check_args(state, args, {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}, what)
        return _limits(state, super().call(__context, __obj, *args, **kwargs), what)

    def getattr(self, obj, attribute):
        _pulse()  # filters like sort(attribute=...) come here once per item
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _pulse()
        return super().getitem(obj, argument)

    def wrap_str_format(self, value):
        if super().wrap_str_format(value) is None:  # not str.format / str.format_map
            return None
        f_self = value.__self__
        formatter = (_BoundedEscapeFormatter(self, escape=f_self.escape) if hasattr(f_self, "__html__")
                     else _BoundedFormatter(self))
        is_format_map = value.__name__ == "format_map"

        def wrapper(*args, **kwargs):
            if is_format_map:
                if kwargs:
                    raise TypeError("format_map() takes no keyword arguments")
                if len(args) != 1:
                    raise TypeError(f"format_map() takes exactly one argument ({len(args)} given)")
                kwargs, args = args[0], ()
            return type(f_self)(formatter.vformat(f_self, args, kwargs))

        return functools.update_wrapper(wrapper, value)


def _make_environment() -> BoundedSandbox:
    """The environment transformers renders chat templates in, bounded: the same options, extensions,
    filters and globals."""
    if tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3]) < (3, 1, 6):
        # As transformers 5.2x asks: older jinja2 has known sandbox escapes.
        raise ImportError(f"chat templates need jinja2>=3.1.6 (older versions have known sandbox escapes), this "
                          f"is {jinja2.__version__}: pip install -U jinja2")
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters["sum"] = _sum
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    env.globals["lipsum"] = _lipsum
    for name, func in list(env.filters.items()):
        env.filters[name] = _bounded_filter(name, func)
    for name, func in list(env.tests.items()):  # select / reject call them once per item
        env.tests[name] = _ticking(func)
    env.filters.update({_LOOP: _loop_filter, _OUTPUT: _output_filter, _CONCAT: _concat_filter,
                        _CHECK: _check_filter})
    return env


def _bound_tree(tree):
    """Rewrite a parsed template: loops step through ``_loop_steps``; every piece of output (template
    text too: inside a macro or a ``set`` block it is collected, not streamed) is measured and charged;
    ``~`` joins through a check; list, tuple and dict literals and slices are measured."""

    def wrap(node, name):
        return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)

    class Bound(NodeTransformer):
        def visit_For(self, node):
            node = self.generic_visit(node)
            node.iter = wrap(node.iter, _LOOP)
            return node

        def visit_Output(self, node):
            node = self.generic_visit(node)
            node.nodes = [wrap(child, _OUTPUT) for child in node.nodes]
            return node

        def visit_Concat(self, node):
            node = self.generic_visit(node)
            return wrap(nodes.List(node.nodes, lineno=node.lineno), _CONCAT)

        def visit_List(self, node):
            return wrap(self.generic_visit(node), _CHECK)

        def visit_Dict(self, node):
            return wrap(self.generic_visit(node), _CHECK)

        def visit_Tuple(self, node):
            node = self.generic_visit(node)
            return wrap(node, _CHECK) if node.ctx == "load" else node

        def visit_Getitem(self, node):
            node = self.generic_visit(node)
            return wrap(node, _CHECK) if isinstance(node.arg, nodes.Slice) else node

    return Bound().visit(tree)


@functools.lru_cache(maxsize=None)
def _environment():
    return _make_environment()


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str):
    """The bounded template of a chat template's source (cached)."""
    if not isinstance(source, str):
        raise TypeError(f"a chat template is a string, got {type(source).__name__}")
    if len(source) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateLimitError(f"the chat template is {len(source):,} characters long, over the limit of "
                                     f"{MAX_TEMPLATE_CHARS:,} (MAX_TEMPLATE_CHARS)")
    env = _environment()
    tree = _bound_tree(env.parse(source))
    tree.set_environment(env)
    return env.from_string(tree)


def _template_line(error: BaseException) -> str:
    """`` (template line N)`` of the innermost template frame of ``error``'s traceback, if any."""
    line, tb = None, error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return "" if line is None else f" (template line {line})"


def render_template(template, variables: dict) -> str:
    """Render a compiled template with ``variables``, streaming and counting its output, under the
    deadline and limits; ``ChatTemplateLimitError`` for a template over them."""
    state = _Render(MAX_ALLOCATED_BYTES)
    items, chars, _ = _measure(list(variables.values()), state)  # also caches the input's measures
    state.seconds = TIME_LIMIT_S + items * TIME_PER_INPUT_ITEM_S + chars * TIME_PER_INPUT_CHAR_S
    state.deadline = time.perf_counter() + state.seconds
    token = _current.set(state)
    try:
        pieces, length = [], 0
        for piece in template.generate(**variables):
            length += len(piece)
            if length > MAX_OUTPUT_CHARS:
                state.refuse(f"the rendered prompt grew past {MAX_OUTPUT_CHARS:,} characters, the limit "
                             "(MAX_OUTPUT_CHARS)")
            state.tick()
            pieces.append(piece)
        return "".join(pieces)
    except _Refused as e:
        raise ChatTemplateLimitError(f"{e}{_template_line(e)}") from None
    except Exception as e:
        if state.refused is not None:  # a refusal something turned into another error
            raise ChatTemplateLimitError(f"{state.refused}{_template_line(e)}") from None
        raise
    finally:
        _current.reset(token)


# ---- what apply_chat_template passes the template -------------------------------------------------


def _plain_template_data(value):
    """transformers' ``_plain_template_data`` (5.2x): what the template sees is rebuilt of plain JSON
    types, anything else becomes an inert ``"<TypeName>"``; the identity for JSON data."""
    import dataclasses
    from collections.abc import Mapping

    import numpy as np

    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain_template_data(k): _plain_template_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_template_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain_template_data(v) for v in value)
    if isinstance(value, np.generic):
        return _plain_template_data(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain_template_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain_template_data(value.model_dump())
    return f"<{type(value).__name__}>"


def template_variables(tokenizer, conversation, *, add_generation_prompt: bool = False, tools=None,
                       documents=None, **kwargs) -> dict:
    """The variables ``tokenizer.apply_chat_template`` renders one conversation with: ``messages`` (as
    transformers normalizes them), ``tools`` (callables as JSON schemas), ``documents``,
    ``add_generation_prompt``, the tokenizer's special tokens (``bos_token``, ...) and ``kwargs``."""
    from transformers.utils import chat_template_utils as hf
    from transformers.utils import get_json_schema

    if isinstance(conversation, (list, tuple)) and len(conversation) == 0:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    # The steps transformers takes, where the installed version takes them (5.2x; 5.17 has none of them).
    normalize = getattr(hf, "_normalize_chat_messages", None)
    alias = getattr(hf, "_alias_reasoning_fields", None)
    plain = getattr(hf, "_plain_template_data", None) or _plain_template_data
    messages = normalize(conversation) if normalize is not None else conversation
    if tools is not None:
        schemas = []
        for tool in tools:
            if isinstance(tool, dict):
                schemas.append(tool)
            elif inspect.isfunction(tool) or inspect.ismethod(tool):
                schemas.append(get_json_schema(tool))
            else:
                raise ValueError("Tools should either be a JSON schema, or a callable function with type hints "
                                 "and a docstring suitable for auto-conversion to a schema.")
        tools = schemas
    if documents is not None:
        for document in documents:
            if not isinstance(document, dict):
                raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    chat = plain(getattr(messages, "messages", messages))
    for message in chat:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
    if alias is not None:
        chat = alias(chat)
    extra = plain({**tokenizer.special_tokens_map, **kwargs})  # kwargs overwrite special tokens
    return dict(messages=chat, tools=plain(tools), documents=plain(documents),
                add_generation_prompt=add_generation_prompt, **extra)


def render_chat_template(tokenizer, conversation, *, add_generation_prompt: bool = False, tools=None,
                         documents=None, chat_template: str | None = None, **kwargs) -> str:
    """``tokenizer.apply_chat_template(conversation, tokenize=False, ...)``, rendered in the bounded
    sandbox: the same text for every template that stays within the limits."""
    source = tokenizer.get_chat_template(chat_template, tools)
    variables = template_variables(tokenizer, conversation, add_generation_prompt=add_generation_prompt,
                                   tools=tools, documents=documents, **kwargs)
    return render_template(compile_chat_template(source), variables)


def encode_chat(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered chat, as ``apply_chat_template`` tokenizes it: no special tokens added
    (the template writes them)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def apply_chat_template(tokenizer, conversation, *, add_generation_prompt: bool = False, tools=None,
                        documents=None, chat_template: str | None = None, **kwargs) -> list[int]:
    """``tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False, ...)`` with the
    template rendered in the bounded sandbox."""
    return encode_chat(tokenizer, render_chat_template(
        tokenizer, conversation, add_generation_prompt=add_generation_prompt, tools=tools, documents=documents,
        chat_template=chat_template, **kwargs))
