"""What one chat-template render may spend. A template is code from outside (the GGUF's, or an
operator's file) run on the worker's loop thread, so no template may hold that thread: every way a
template does work is either counted against the budget below or bounded before it is done.

- printed text: MAX_OUTPUT_CHARS characters (tojson counts as it writes);
- steps: MAX_LOOP_STEPS, counting every loop iteration, call (macros, methods, globals), filter,
  test, item of a lazy filter's result and container a size check walks;
- time: MAX_RENDER_SECONDS of the rendering thread's CPU time (a busy box stretches a render's
  wall clock, not its work: the wall would call a big but honest render hostile under load),
  looked at every CLOCK_EVERY charges. Each single operation is bounded (below), so the clock ends
  a render that spends its steps on slow but bounded work;
- every string an operation builds: MAX_OUTPUT_CHARS, estimated from the operands BEFORE it is
  built where an argument sets the size (a width, a count, a separator times the items, a
  repetition), checked after where the result is at most a small multiple of its input;
- every list, tuple and dict the template builds or is handed back: MAX_NODES nodes and
  MAX_VALUE_CHARS characters counted with their shared references (a list holding the previous one
  twice, twenty times over, is a million nodes), MAX_DEPTH deep. So comparing, hashing, printing
  or serializing any value a template holds is bounded work;
- integers: MAX_INT_BITS bits, checked before `*` and `**` compute them (`9 ** (9 ** 9)`).

Every method of the builtin types a template can reach and every filter is in a table below:
bounded by its input (checked after) or sized by an argument (a rule checks before); a method not
in the table is refused. tests/test_render_budget.py holds the tables complete.
"""

from __future__ import annotations

import re
import time
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, MappingView, Set
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import update_wrapper
from itertools import chain
from typing import Any, NamedTuple, cast

from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.filters import make_attrgetter
from jinja2.sandbox import (
    ImmutableSandboxedEnvironment,
    SandboxedEscapeFormatter,
    SandboxedFormatter,
    SecurityError,
)
from jinja2.utils import Namespace, _PassArg, generate_lorem_ipsum, pass_environment
from markupsafe import Markup

MAX_OUTPUT_CHARS = 4 * 1024 * 1024  # past this a template is hostile, not a chat
MAX_LOOP_STEPS = 1_000_000  # steps in one render: nested loops multiply
MAX_RANGE = 100_000  # one range(), as Jinja2's sandbox caps it
MAX_NODES = MAX_LOOP_STEPS  # items in one value, shared references counted each time
MAX_VALUE_CHARS = 4 * MAX_OUTPUT_CHARS  # characters in one value, shared references counted each time
MAX_DEPTH = 256  # nesting of one value (Python's hash of nested tuples recurses in C)
MAX_INT_BITS = 1 << 16
MAX_RENDER_SECONDS = 5.0  # a chat renders in milliseconds; this is a runaway
CLOCK_EVERY = 32  # charges between two looks at the CPU clock (a look costs about a microsecond)


class Limit(SecurityError):
    """A render went past a size, step or time limit: the template is hostile, whatever the chat."""


@dataclass
class Render:
    guard: Callable[[str], str] | None  # what the template's tojson writes each string through
    deadline: float  # time.thread_time()
    chars: int = 0  # every piece printed, what macros and {% set %} blocks buffer included
    steps: int = 0
    charges: int = 0


_STATE: ContextVar[Render | None] = ContextVar("jinja_template_render", default=None)


@contextmanager
def rendering(guard: Callable[[str], str] | None) -> Iterator[Render]:
    """One render's budget, for the code that runs in it."""
    token = _STATE.set(Render(guard, time.thread_time() + MAX_RENDER_SECONDS))
    try:
        yield _STATE.get()  # type: ignore[misc]
    finally:
        _STATE.reset(token)


def current() -> Render | None:
    return _STATE.get()


def charge(chars: int = 0, steps: int = 0) -> None:
    if (state := _STATE.get()) is not None:
        state.chars, state.steps = state.chars + chars, state.steps + steps
        if state.chars > MAX_OUTPUT_CHARS or state.steps > MAX_LOOP_STEPS:
            raise Limit(f"template printed past {MAX_OUTPUT_CHARS} characters or looped past "
                        f"{MAX_LOOP_STEPS} steps")
        state.charges += 1
        if state.charges % CLOCK_EVERY == 0 and time.thread_time() > state.deadline:
            raise Limit(f"template rendered past {MAX_RENDER_SECONDS:g} seconds")


def fits(size: int, what: str) -> None:
    """A string of `size` characters may be built (checked before building it)."""
    if size > MAX_OUTPUT_CHARS:
        raise Limit(f"{what} longer than {MAX_OUTPUT_CHARS} characters")


def _int_fits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise Limit(f"integer longer than {MAX_INT_BITS} bits")


# -- the size of a value ---------------------------------------------------------------------------


class Weight(NamedTuple):
    nodes: int  # containers and leaves, each shared reference counted again
    chars: int  # its leaves' characters (and about what its repr adds), counted the same way
    depth: int


class WList(list[Any]):
    """A list the template built, its weight known (so building on it costs no walk)."""

    __slots__ = ("weight",)
    weight: Weight


class WDict(dict[Any, Any]):
    __slots__ = ("weight",)
    weight: Weight


class WTuple(tuple[Any, ...]):
    weight: Weight


_WEIGHED = (WList, WDict, WTuple)
_SCALAR = Weight(1, 24, 0)  # none, a bool, a float: a repr of at most 24 characters
_OBJECT = Weight(1, 100, 0)  # anything else (a macro, a cycler, a namespace): its own repr is bounded


def weight(v: Any, level: int = 0, seen: dict[int, Weight] | None = None) -> Weight:
    """Nodes and characters of `v`, shared references counted each time; refused past the limits
    as soon as a walk passes them. Each container walked is a step, and is walked once per walk
    (`seen`), so a value sharing its parts is weighed in the time its distinct parts take."""
    if isinstance(v, _WEIGHED):
        return v.weight
    if isinstance(v, str | bytes):
        return Weight(1, len(v) + 2, 0)
    if isinstance(v, int) and not isinstance(v, bool):
        return Weight(1, v.bit_length() // 3 + 2, 0)
    if v is None or isinstance(v, bool | float):
        return _SCALAR
    items = _children(v)
    if items is None:
        return _OBJECT
    if seen is None:
        seen = {}
    elif (known := seen.get(id(v))) is not None:  # the walk holds `v`: its id is not reused meanwhile
        return known
    if level >= MAX_DEPTH:
        raise Limit(f"a value nested past {MAX_DEPTH} levels")
    charge(steps=1)
    seen[id(v)] = w = _combine(items, level, seen)
    return w


def _children(v: Any) -> Iterable[Any] | None:
    # the base types' own iteration: the capability probes' dicts note what a template reads
    if isinstance(v, dict):
        return chain.from_iterable(dict.items(v))
    if isinstance(v, list):
        return list.__iter__(v)
    if isinstance(v, tuple):
        return tuple.__iter__(v)
    if isinstance(v, Mapping):
        return chain.from_iterable(v.items())
    if isinstance(v, MappingView | Set):
        return cast(Iterable[Any], v)
    if isinstance(v, Namespace):  # what it holds now (it may change later: its repr counts itself)
        return chain.from_iterable(dict.items(v._Namespace__attrs))
    return None


def _combine(items: Iterable[Any], level: int = 0, seen: dict[int, Weight] | None = None) -> Weight:
    nodes_, chars, depth = 1, 2, 0
    seen = {} if seen is None else seen
    for item in items:
        w = weight(item, level + 1, seen)
        nodes_, chars, depth = nodes_ + w.nodes, chars + w.chars + 2, max(depth, w.depth)
        if nodes_ > MAX_NODES or chars > MAX_VALUE_CHARS:
            raise Limit(f"a value longer than {MAX_NODES} items or {MAX_VALUE_CHARS} characters")
    if depth >= MAX_DEPTH:
        raise Limit(f"a value nested past {MAX_DEPTH} levels")
    return Weight(nodes_, chars, depth + 1)


def _weighed(kind: type[Any], items: Iterable[Any], w: Weight) -> Any:
    out = kind(items)
    out.weight = w
    return out


def built_list(items: tuple[Any, ...]) -> WList:
    """A list literal of the template's."""
    charge(steps=1)
    return _weighed(WList, items, _combine(items))


def built_tuple(items: tuple[Any, ...]) -> WTuple:
    charge(steps=1)
    return _weighed(WTuple, items, _combine(items))


def built_dict(items: dict[Any, Any]) -> WDict:
    charge(steps=1)
    return _weighed(WDict, items, _combine(chain.from_iterable(items.items())))


def str_size(v: Any) -> int:
    """About len(str(v)), known before it is built: a string's length, a container's weight
    (a repr's escapes aside: those at most multiply one string's length, checked after)."""
    if isinstance(v, str):
        return len(v)
    w = weight(v)
    return w.chars + 2 * w.nodes


def stringified(v: Any) -> str:
    """str(v), refused before it is built when it would be too long."""
    if not isinstance(v, str):
        fits(str_size(v), "a value's text")
    text = str(v)
    fits(len(text), "a value's text")
    return text


def admitted(v: Any) -> Any:
    """What an operation handed back, checked: a string's length, an integer's size, a
    container's weight; a lazy result counts each item it yields as a step."""
    if isinstance(v, str | bytes):
        fits(len(v), "a string")
    elif isinstance(v, int) and not isinstance(v, bool):
        _int_fits(v.bit_length())
    elif isinstance(v, Iterator) and not isinstance(v, Mapping):
        return _counted(v)
    elif not isinstance(v, _WEIGHED) and _children(v) is not None:
        weight(v)
    return v


def _counted(items: Iterator[Any]) -> Iterator[Any]:
    for item in items:
        charge(steps=1)
        yield admitted(item)


class BoundedNamespace(Namespace):
    """namespace(): its repr (what printing a list holding it writes) counted like a value's, so
    namespaces holding namespaces twice over cannot print exponentially in C."""

    def __repr__(self) -> str:
        charge(steps=1)
        return f"<Namespace {stringified(self._Namespace__attrs)}>"


def bounded_range(*args: int) -> WList:
    if len(values := range(*args)) > MAX_RANGE:
        raise Limit(f"range() longer than {MAX_RANGE}")
    return _weighed(WList, values, Weight(len(values) + 1, 2 + 24 * len(values), 1))


def bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    fits(_int(n) * _int(max) * 16, "lipsum()")  # a word and its space: at most 16 characters
    return generate_lorem_ipsum(n, html, min, max)


# -- sizes set by an argument ----------------------------------------------------------------------

Sizer = Callable[[Any, list[Any], dict[str, Any]], int]
"""A rule: (the text or object worked on, the arguments, which it may replace: a lazy iterable read
once into a list) -> the size of the result, checked against the limit before the work is done."""


def _int(v: Any) -> int:
    return v if isinstance(v, int) else 0  # not an int: the operation itself raises


def _arg(args: list[Any], kwargs: dict[str, Any], i: int, name: str, default: Any) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _len(v: Any) -> int:
    return len(v) if isinstance(v, str | bytes) else 0


def _padded(s: Any, args: list[Any], kwargs: dict[str, Any]) -> int:
    """center, ljust, rjust, zfill: the width."""
    return max(_len(s), _int(_arg(args, kwargs, 0, "width", 0)))


def _expanded(s: Any, args: list[Any], kwargs: dict[str, Any]) -> int:
    tab = "\t" if isinstance(s, str) else b"\t"
    return _len(s) + _count(s, tab) * max(_int(_arg(args, kwargs, 0, "tabsize", 8)), 1)


def _count(s: Any, part: Any) -> int:
    return int(s.count(part))


def replaced_size(s: Any, old: Any, new: Any, count: Any) -> int:
    if not isinstance(s, str | bytes) or not isinstance(old, str | bytes) or not isinstance(new, str | bytes):
        return _len(s)
    hits = len(s) + 1 if not old else _count(s, old)  # "" matches between every two characters
    if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(len(new) - len(old), 0)


def _replaced(s: Any, args: list[Any], kwargs: dict[str, Any]) -> int:
    return replaced_size(s, _arg(args, kwargs, 0, "old", ""), _arg(args, kwargs, 1, "new", ""),
                         _arg(args, kwargs, 2, "count", -1))


def joined_size(sep: Any, items: list[Any]) -> int:
    return sum(str_size(x) for x in items) + str_size(sep) * max(len(items) - 1, 0)


def _listed(v: Any) -> Any:
    """A lazy iterable read once (each item a step), so its size is known before it is joined."""
    return list(v) if isinstance(v, Iterator) else v


def _joined(sep: Any, args: list[Any], kwargs: dict[str, Any]) -> int:
    if not args:
        return 0
    args[0] = _listed(args[0])
    items = args[0]
    if isinstance(items, str | bytes):
        return len(items) * (1 + _len(sep))
    return joined_size(sep, list(items) if isinstance(items, Iterable) else [])


def _translated(s: Any, args: list[Any], kwargs: dict[str, Any]) -> int:
    table = _arg(args, kwargs, 0, "table", None)
    values = table.values() if isinstance(table, Mapping) else table if isinstance(table, list | tuple) \
        else ()
    return _len(s) * max([1, *(str_size(v) for v in values)])


def _to_bytes(n: Any, args: list[Any], kwargs: dict[str, Any]) -> int:
    return _int(_arg(args, kwargs, 0, "length", 1))


def _refused(obj: Any, args: list[Any], kwargs: dict[str, Any]) -> int:
    raise SecurityError("this method is not available in a chat template")


def _bounded(names: str) -> dict[str, Sizer | None]:
    return dict.fromkeys(names.split(), None)


# None: the result is at most a small multiple of the input's size (checked after it is built)
STR_METHODS: dict[str, Sizer | None] = {
    **_bounded("capitalize casefold count encode endswith find index isalnum isalpha isascii "
               "isdecimal isdigit isidentifier islower isnumeric isprintable isspace istitle isupper "
               "lower lstrip maketrans partition removeprefix removesuffix rfind rindex rpartition "
               "rsplit rstrip split splitlines startswith strip swapcase title upper "
               "decode fromhex hex "  # bytes
               "escape striptags unescape"),  # markupsafe.Markup
    "center": _padded, "ljust": _padded, "rjust": _padded, "zfill": _padded,
    "expandtabs": _expanded, "replace": _replaced, "join": _joined, "translate": _translated,
    # reached as the bounded formatter's wrappers (BoundedEnvironment.wrap_str_format), never as these
    "format": _refused, "format_map": _refused,
}
INT_METHODS: dict[str, Sizer | None] = {
    **_bounded("as_integer_ratio bit_count bit_length conjugate from_bytes "
               "fromhex hex is_integer"),  # float
    "to_bytes": _to_bytes,
}
SEQUENCE_METHODS: dict[str, Sizer | None] = _bounded("copy count index")
DICT_METHODS: dict[str, Sizer | None] = _bounded("copy fromkeys get items keys values isdisjoint")
_METHOD_TABLES: tuple[tuple[type | tuple[type, ...], dict[str, Sizer | None]], ...] = (
    ((str, bytes), STR_METHODS), ((int, float), INT_METHODS), ((list, tuple), SEQUENCE_METHODS),
    ((dict, MappingView), DICT_METHODS),
)


def method_rule(obj: Any) -> tuple[str, Sizer | None] | None:
    """(name, rule) of a method of a builtin type (a str, a list, ...); None for any other callable
    (a macro, a global, a namespace's); SecurityError for a method no table names."""
    if not isinstance(obj, types.BuiltinMethodType | types.MethodType):
        return None
    owner = obj.__self__
    kind = owner if isinstance(owner, type) else type(owner)
    name = obj.__name__
    for bases, table in _METHOD_TABLES:
        if issubclass(kind, bases):
            if name not in table:
                raise SecurityError(f"{kind.__name__}.{name}() is not available in a chat template")
            return name, table[name]
    return None


# -- printf and str.format -------------------------------------------------------------------------

_PRINTF = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?[a-zA-Z%]")
_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(\d*)[,_]?(?:\.(\d+))?[a-zA-Z%]?")
_MARGIN = 32  # what a conversion adds past its width and precision: a sign, digits, an exponent


def printf_size(fmt: Any, values: Any) -> int:
    """`fmt % values` (the `format` filter, the `%` operator): widths and precisions are sizes."""
    if not isinstance(fmt, str):
        return 0
    size = len(fmt) + str_size(values)
    for width, precision in _PRINTF.findall(fmt):
        if "*" in (width, precision):
            raise SecurityError("'*' widths in % formats are not available in a chat template")
        size += int(width or 0) + int(precision or 0) + _MARGIN
    return size


class _Bounded(SandboxedFormatter):
    """str.format with each field's size (width, precision, the value's text) counted before it is
    formatted, the sum of them all held to the limit."""

    def vformat(self, format_string: str, args: Any, kwargs: Any) -> str:
        self._size = len(format_string)
        return super().vformat(format_string, args, kwargs)

    def _add(self, size: int) -> None:
        self._size += size
        fits(self._size, "a str.format() result")

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if conversion is not None:
            self._add(str_size(value))
        return super().convert_field(value, conversion)

    def format_field(self, value: Any, format_spec: str) -> Any:
        charge(steps=1)
        spec = _SPEC.fullmatch(format_spec)
        width, precision = (int(spec[1] or 0), int(spec[2] or 0)) if spec else (0, 0)
        if not spec:  # a type's own spec language: its size is the spec's digits at most
            width = sum(int(d) for d in re.findall(r"\d+", format_spec))
        self._add(max(width, str_size(value) + precision + _MARGIN))
        return super().format_field(value, format_spec)


class _BoundedEscape(_Bounded, SandboxedEscapeFormatter):
    pass


# -- filters ---------------------------------------------------------------------------------------

Rule = Callable[[Any, list[Any], dict[str, Any]], int]
"""A filter's rule: (the eval context or environment Jinja2 passes it, or None; its positional
arguments, the value first, which it may replace; its keyword ones) -> the result's size, checked
before the filter runs."""


def _center(passed: Any, a: list[Any], kw: dict[str, Any]) -> int:
    return max(str_size(a[0]), _int(_arg(a, kw, 1, "width", 80)))


def _indent(passed: Any, a: list[Any], kw: dict[str, Any]) -> int:
    width = _arg(a, kw, 1, "width", 4)
    pad = len(width) if isinstance(width, str) else _int(width)
    fits(pad, "indent()'s indentation")
    text = a[0] if isinstance(a[0], str) else ""
    return str_size(a[0]) + (text.count("\n") + 1) * pad


def _wordwrap(passed: Any, a: list[Any], kw: dict[str, Any]) -> int:
    wrap = _arg(a, kw, 3, "wrapstring", None)
    text = a[0] if isinstance(a[0], str) else ""
    lines = str_size(a[0]) // max(_int(_arg(a, kw, 1, "width", 79)), 1) + text.count("\n") + 1
    return str_size(a[0]) + lines * (str_size(wrap) if wrap is not None else 2)


def _replace(passed: Any, a: list[Any], kw: dict[str, Any]) -> int:
    return replaced_size(a[0], _arg(a, kw, 1, "old", ""), _arg(a, kw, 2, "new", ""),
                         _arg(a, kw, 3, "count", None))


def _join(passed: Any, a: list[Any], kw: dict[str, Any]) -> int:
    a[0] = items = list(_listed(a[0])) if not isinstance(a[0], str) else a[0]
    attribute = _arg(a, kw, 2, "attribute", None)
    if attribute is not None and not isinstance(items, str):
        get = make_attrgetter(passed.environment, attribute)
        items = [get(x) for x in items]
    return joined_size(_arg(a, kw, 1, "d", ""), list(items))


def _format(passed: Any, a: list[Any], kw: dict[str, Any]) -> int:
    return printf_size(a[0], kw or tuple(a[1:]))


def _batch(passed: Any, a: list[Any], kw: dict[str, Any]) -> int:
    fill = _arg(a, kw, 2, "fill_with", None)
    if fill is None:
        return 0
    count = _int(_arg(a, kw, 1, "linecount", 0))
    w = weight(fill)
    if count * w.nodes > MAX_NODES or count * w.chars > MAX_VALUE_CHARS:
        raise Limit(f"batch() longer than {MAX_NODES} items")
    return 0


def _urlize(passed: Any, a: list[Any], kw: dict[str, Any]) -> int:
    attrs = sum(str_size(_arg(a, kw, i, name, "")) for i, name in ((3, "target"), (4, "rel")))
    return 3 * str_size(a[0]) + (str_size(a[0]) // 2 + 1) * (attrs + 64)  # per word: a link's markup


def _text(passed: Any, a: list[Any], kw: dict[str, Any]) -> int:
    """A filter that works on its value's text: a container's repr is built first."""
    return str_size(a[0])


def _pprint(passed: Any, a: list[Any], kw: dict[str, Any]) -> int:
    w = weight(a[0])
    return 2 * str_size(a[0]) + w.nodes * w.depth  # a line per item, indented by its depth


FILTERS: dict[str, Rule | None] = {
    # bounded by the input: its size or a few times it, checked after
    **_bounded("abs attr count d default dictsort filesizeformat first float groupby int items last "
               "length list map max min random reject rejectattr reverse round safe select selectattr "
               "slice sort tojson unique"),
    # bounded too, but they work on the value's text: a container's repr is sized first
    **dict.fromkeys(_bounded("capitalize e escape forceescape lower string striptags title trim "
                             "truncate upper urlencode wordcount xmlattr"), _text),
    # sized by an argument, checked before
    "center": _center, "indent": _indent, "wordwrap": _wordwrap, "replace": _replace, "join": _join,
    "format": _format, "batch": _batch, "urlize": _urlize, "pprint": _pprint,
    "sum": None,  # bounded_sum: sequences joined once
}
def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    rule = FILTERS.get(name, _unknown_filter)
    passed = 1 if _PassArg.from_obj(func) is not None else 0

    def bounded(*args: Any, **kwargs: Any) -> Any:
        charge(steps=1)
        if rule is not None:
            rest = list(args[passed:])
            fits(rule(args[0] if passed else None, rest, kwargs), f"the {name} filter's result")
            args = (*args[:passed], *rest)
        return admitted(func(*args, **kwargs))

    return _passing(bounded, func)


def _unknown_filter(passed: Any, a: list[Any], kw: dict[str, Any]) -> int:
    raise SecurityError("this filter is not available in a chat template")


def _counted_test(func: Callable[..., Any]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        charge(steps=1)
        return func(*args, **kwargs)

    return _passing(counted, func)


def _passing(wrapper: Callable[..., Any], func: Callable[..., Any]) -> Callable[..., Any]:
    """`wrapper` called as Jinja2 calls `func` (with the context, eval context or environment first)."""
    update_wrapper(wrapper, func)
    wrapper.__dict__["bounded"] = True
    return wrapper


@pass_environment
def bounded_sum(environment: Any, iterable: Iterable[Any], attribute: str | int | None = None,
                start: Any = 0) -> Any:
    """Jinja2's sum, but lists (tuples) added to a list (tuple) are joined once: Python's sum copies
    the total at every item, a million one-item lists a trillion copies."""
    if attribute is not None:
        iterable = map(make_attrgetter(environment, attribute), iterable)
    if not isinstance(start, list | tuple):
        return sum(iterable, start)
    items = list(iterable)
    kind = list if isinstance(start, list) else tuple
    for item in items:
        if not isinstance(item, kind):
            raise TypeError(f'can only concatenate {kind.__name__} (not "{type(item).__name__}") to '
                            f"{kind.__name__}")
    if len(start) + sum(len(x) for x in items) > MAX_NODES:
        raise Limit(f"sum() longer than {MAX_NODES} items")
    return kind(chain(start, *items))


# -- the environment -------------------------------------------------------------------------------


class BoundedCodegen(CodeGenerator):
    """Literals are weighed as they are built; every loop iteration (and a filtered loop's every
    test) is a step."""

    def writeline(self, x: str, node: nodes.Node | None = None, extra: int = 0) -> None:
        super().writeline(x, node, extra)
        if x == "_loop_vars = {}":  # the first line of a for loop's body (jinja2's visit_For)
            super().writeline("environment.loop_step()")

    def visit_For(self, node: nodes.For, frame: Any) -> None:
        if node.test is not None:
            node.test = nodes.Call(nodes.EnvironmentAttribute("loop_test"), [node.test], [], None, None,
                                   lineno=node.test.lineno)
        super().visit_For(node, frame)

    def _built(self, kind: str, node: nodes.Tuple | nodes.List | nodes.Dict, frame: Any,
               visit: Callable[[Any, Any], None]) -> None:
        self.write(f"environment.built_{kind}(")
        visit(node, frame)
        self.write(")")

    def visit_List(self, node: nodes.List, frame: Any) -> None:
        self._built("list", node, frame, lambda n, f: self._tuple_of(n.items, f))

    def visit_Tuple(self, node: nodes.Tuple, frame: Any) -> None:
        if node.ctx != "load":  # an assignment's target
            super().visit_Tuple(node, frame)
            return
        self._built("tuple", node, frame, lambda n, f: self._tuple_of(n.items, f))

    def visit_Dict(self, node: nodes.Dict, frame: Any) -> None:
        self._built("dict", node, frame, super().visit_Dict)

    def _tuple_of(self, items: list[nodes.Expr], frame: Any) -> None:
        self.write("(")
        for item in items:
            self.visit(item, frame)
            self.write(", ")
        self.write(")")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """Jinja2's immutable sandbox with the budget: calls, operators, filters and tests checked."""

    code_generator_class = BoundedCodegen
    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.globals.update(range=bounded_range, lipsum=bounded_lipsum, namespace=BoundedNamespace)
        self.filters["sum"] = bounded_sum

    # every filter and test, the ones added after __init__ too, counted when the template compiles
    def _parse(self, *args: Any, **kwargs: Any) -> Any:
        for table, wrap in ((self.filters, _bounded_filter), (self.tests, None)):
            for name, func in list(table.items()):
                if not getattr(func, "bounded", False):
                    table[name] = wrap(name, func) if wrap else _counted_test(func)
        return super()._parse(*args, **kwargs)

    def loop_step(self) -> None:
        charge(steps=1)

    def loop_test(self, value: Any) -> Any:
        return value  # called through call(): a step

    def built_list(self, items: tuple[Any, ...]) -> WList:
        return built_list(items)

    def built_tuple(self, items: tuple[Any, ...]) -> WTuple:
        return built_tuple(items)

    def built_dict(self, items: dict[Any, Any]) -> WDict:
        return built_dict(items)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        charge(steps=1)
        for value in chain(args, kwargs.values()):  # a macro's varargs and kwargs, passed on again
            if isinstance(value, tuple | dict) and not isinstance(value, _WEIGHED):
                weight(value)
        name, sizer = method_rule(obj) or ("", None)
        if sizer is not None:
            listed = list(args)
            fits(sizer(obj.__self__, listed, kwargs), f"{name}()'s result")
            args = tuple(listed)
        return admitted(super().call(context, obj, *args, **kwargs))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        charge(steps=1)
        if operator == "*":
            return self._times(context, left, right)
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 \
                and abs(left) > 1:
            _int_fits(left.bit_length() * right)
        if operator == "%" and isinstance(left, str):
            fits(printf_size(left, right), "a % format's result")
        result = super().call_binop(context, operator, left, right)
        if operator == "+" and isinstance(result, list | tuple) and not isinstance(result, _WEIGHED):
            kind = WList if isinstance(result, list) else WTuple
            return _weighed(kind, result, _sum_weights(weight(left), weight(right)))
        return admitted(result)

    def _times(self, context: Any, left: Any, right: Any) -> Any:
        seq, times = (left, right) if isinstance(left, str | bytes | list | tuple) else (right, left)
        if isinstance(seq, str | bytes | list | tuple) and isinstance(times, int):
            n = max(times, 0)
            if isinstance(seq, str | bytes):
                fits(len(seq) * n, "a repetition")
            else:
                w = weight(seq)
                if (w.nodes - 1) * n > MAX_NODES or (w.chars - 2) * n > MAX_VALUE_CHARS:
                    raise Limit(f"a repetition longer than {MAX_NODES} items")
                kind = WList if isinstance(seq, list) else WTuple
                return _weighed(kind, seq * n, Weight(1 + (w.nodes - 1) * n, 2 + (w.chars - 2) * n, w.depth))
        elif isinstance(left, int) and isinstance(right, int):
            _int_fits(left.bit_length() + right.bit_length())
        return admitted(super().call_binop(context, "*", left, right))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """str.format and format_map through the bounded formatter (Jinja2's own, sized)."""
        if not isinstance(value, types.MethodType | types.BuiltinMethodType) \
                or value.__name__ not in ("format", "format_map") or not isinstance(value.__self__, str):
            return None
        text: str = value.__self__
        formatter = _BoundedEscape(self, escape=text.escape) if isinstance(text, Markup) else _Bounded(self)
        is_map = value.__name__ == "format_map"

        def wrapper(*args: Any, **kwargs: Any) -> str:
            if is_map and (kwargs or len(args) != 1):
                raise TypeError("format_map() takes exactly one argument")
            out = formatter.vformat(text, (), args[0]) if is_map else formatter.vformat(text, args, kwargs)
            return type(text)(out)

        return update_wrapper(wrapper, value)


def _sum_weights(a: Weight, b: Weight) -> Weight:
    w = Weight(a.nodes + b.nodes - 1, a.chars + b.chars - 2, max(a.depth, b.depth))
    if w.nodes > MAX_NODES or w.chars > MAX_VALUE_CHARS:
        raise Limit(f"a value longer than {MAX_NODES} items or {MAX_VALUE_CHARS} characters")
    return w
