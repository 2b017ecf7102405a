"""A chat template's render can never run away (backends/chat/render_budget.py): every way a
hostile template builds a string, a number or a value, or loops, is refused before it costs more
than the budget, or stopped by the render's clock.

Each hostile template renders in a forked child with a timeout and an address-space cap, so one
that would hang or exhaust memory (as each did before the budget: minutes, gigabytes or a segfault)
fails its case instead of the test session. What a case must give: a limit named in a TemplateError
within SECONDS of the child's CPU, or, for work the budget bounds without refusing it, the right
answer as fast. CPU, not wall time: a loaded machine (the parallel suite) stretches the wall clock,
not the work.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import string
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.chat.jinja_template import ChatTemplate, TemplateError

SECONDS = 30.0  # CPU: far above what the budget lets a render take (MAX_RENDER_SECONDS), far below a hang
HANG = 120.0  # wall seconds without an answer: the child is taken for hung
USER = [{"role": "user", "content": "x"}]
BIG = "{% set s = 'x' * 4000000 %}"  # a string the budget allows


def render_in_child(source: str, extra: dict[str, Any] | None = None,
                    messages: list[dict[str, Any]] | None = None) -> tuple[str, str, float]:
    """(outcome, detail, seconds): "limit" (a TemplateError naming a limit), "ok" (the output),
    "error" (another failure), "timeout" or "crash" (the child died: a signal, out of memory);
    the child's CPU seconds, or the wall seconds waited for one that never answered."""
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_render, args=(send, source, extra, messages or USER))
    started = time.monotonic()
    child.start()
    send.close()
    try:
        if not receive.poll(HANG):
            return "timeout", "", time.monotonic() - started
        outcome, detail, cpu = receive.recv()
        return outcome, detail, cpu
    except EOFError:
        child.join(5)
        return "crash", f"exit {child.exitcode}", time.monotonic() - started
    finally:
        if child.is_alive():
            child.kill()
        child.join(5)


def _render(send: Any, source: str, extra: dict[str, Any] | None, messages: list[dict[str, Any]]) -> None:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[0])
    resource.setrlimit(resource.RLIMIT_AS, (pages * os.sysconf("SC_PAGE_SIZE") + 2 * 2**30,) * 2)
    try:
        out = ChatTemplate(source).render(messages, extra=extra)
        send.send(("ok", out[:200], time.process_time()))  # a forked child's count starts at 0
    except TemplateError as e:
        limit = any(w in str(e) for w in ("past", "longer")) and "MemoryError" not in str(e)
        send.send(("limit" if limit else "error", str(e)[:300], time.process_time()))
    except BaseException as e:  # reported to the parent, which fails the case
        send.send(("error", f"{type(e).__name__}: {e}"[:300], time.process_time()))


# every escape a review found, and their kin: each one hung, ran for minutes, asked for gigabytes
# or crashed the process before the budget
HOSTILE = {
    "ljust width": "{{ 'x'.ljust(10**9) | length }}",
    "rjust width": "{{ 'x'.rjust(10**9) | length }}",
    "center width": "{{ 'x'.center(10**9) | length }}",
    "center filter": "{{ 'x' | center(10**9) | length }}",
    "zfill width": "{{ '1'.zfill(10**9) | length }}",
    "format width": "{{ '{:>1000000000}'.format('x') | length }}",
    "format precision": "{{ '{:.1000000000f}'.format(1.5) | length }}",
    "format nested width": "{{ '{:{w}}'.format('x', w=10**9) | length }}",
    "format_map width": "{{ '{a:>1000000000}'.format_map({'a': 'x'}) | length }}",
    "printf width": "{{ ('%1000000000s' % 'x') | length }}",
    "format filter width": "{{ '%1000000000d' | format(1) | length }}",
    "replace empty": BIG + "{{ s.replace('', s) | length }}",
    "replace doubling": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                        "{% set ns.s = ns.s.replace('x', 'xx') %}{% endfor %}{{ ns.s | length }}",
    "replace filter": BIG + "{{ s | replace('x', s) | length }}",
    "join separator": "{{ range(100000) | join('x' * 1000000) | length }}",
    "join method": "{{ ('x' * 1000000).join(range(2000) | map('string')) | length }}",
    "join shared items": "{% set l = ['x' * 1000000] * 2000 %}{{ l | join | length }}",
    "indent width": "{{ 'a\nb' | indent(10**10) | length }}",
    "indent lines": "{{ ('a\n' * 100000) | indent(100000) | length }}",
    "wordwrap wrapstring": "{{ ('a ' * 1000000) | wordwrap(1, wrapstring='x' * 1000000) | length }}",
    "expandtabs": "{{ ('\t' * 1000000).expandtabs(1000000) | length }}",
    "translate": "{{ ('x' * 1000000).translate({120: 'y' * 1000000}) | length }}",
    "to_bytes": "{{ (1).to_bytes(10**10, 'big') | length }}",
    "power": "{{ 9 ** (9 ** 9) }}",
    "squaring": "{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}"
                "{% endfor %}{{ ns.n > 0 }}",
    "lipsum": "{{ lipsum(10**9) | length }}",
    "batch fill": "{{ [1] | batch(10**9, 'x') | list | length }}",
    "loop over a string": BIG + "{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "filtered loop": BIG + "{% for i in range(100000) %}{% for c in s if c == 'y' %}{% endfor %}"
                     "{% endfor %}",
    "slow steps": BIG + "{% for i in range(99) %}{% for j in range(10000) %}{% if 'y' in s %}"
                  "{% endif %}{% endfor %}{% endfor %}",
    "shared list tojson": "{% set ns = namespace(x=[1]) %}{% for i in range(40) %}"
                          "{% set ns.x = [ns.x, ns.x] %}{% endfor %}{{ ns.x | tojson | length }}",
    "shared list compare": "{% set a = ['x' * 4000000] * 1000000 %}{% set b = ['x' * 4000000] * 1000000 %}"
                           "{{ a == b }}",
    "namespace repr": "{% set st = namespace(p=none) %}{% for i in range(60) %}"
                      "{% set st.p = namespace(a=st.p, b=st.p) %}{% endfor %}{{ (st.p ~ '') | length }}",
    "macro varargs": "{% macro m(n) %}{% if n %}{{ m(n - 1, varargs, varargs) }}{% else %}"
                     "{{ {varargs: 1} | length }}{% endif %}{% endmacro %}{{ m(60) }}",
    "deep tuple hash": "{% set ns = namespace(t=()) %}{% for i in range(99) %}{% for j in range(10000) %}"
                       "{% set ns.t = (ns.t,) %}{% endfor %}{% endfor %}{{ {ns.t: 1} | length }}",
    "recursive macro": "{% macro m(d) %}{% if d %}{{ m(d - 1) }}{{ m(d - 1) }}{% endif %}{% endmacro %}"
                       "{{ m(60) }}",
}


@pytest.mark.parametrize("source", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_template_is_refused_in_bounded_time(source: str) -> None:
    outcome, detail, seconds = render_in_child(source)
    print(f"{outcome} after {seconds:.2f} s: {detail[:120]}")
    assert outcome == "limit", (outcome, detail)
    assert seconds < SECONDS


def test_tojson_of_shared_references_is_charged_as_it_is_written() -> None:
    """A value no template could build (chat_template_kwargs hold JSON), handed in: tojson, printing
    and stringifying it walk it node by node, each node a step, so it stops in a second."""
    dag: Any = [1]
    for _ in range(40):
        dag = [dag, dag]
    for source in ("{{ x | tojson | length }}", "{{ x }}", "{{ (x ~ '') | length }}", "{{ x | string }}"):
        outcome, detail, seconds = render_in_child(source, extra={"x": dag})
        assert outcome == "limit" and seconds < SECONDS, (source, outcome, detail)


def test_bounded_work_is_done_not_refused() -> None:
    """Adding a million one-item lists is linear (Python's sum copies the total at each item)."""
    outcome, detail, seconds = render_in_child("{{ ([[1]] * 300000) | sum(start=[]) | length }}")
    assert (outcome, detail) == ("ok", "300000") and seconds < SECONDS


@pytest.mark.parametrize(("source", "expected"), [
    ("{{ 'x'.ljust(3) }}|{{ 'x' | center(3) }}|{{ '7'.zfill(3) }}|{{ '{:>3}'.format('x') }}",
     "x  | x |007|  x"),
    ("{{ '%3d' % 7 }}|{{ '%s-%s' | format(1, 2) }}|{{ 'aXa'.replace('X', 'yy') }}|{{ [1, 2] | join('+') }}",
     "  7|1-2|ayya|1+2"),
    ("{{ 'a\nb' | indent(2) }}|{{ 'a b c' | wordwrap(1) }}|{{ 2 ** 10 }}|{{ [[1], [2]] | sum(start=[]) }}",
     "a\n  b|a\nb\nc|1024|12"),
    ("{% set ns = namespace(l=[]) %}{% for m in messages %}{% set ns.l = ns.l + [m.content] %}{% endfor %}"
     "{{ ns.l | join(',') }}|{{ ns }}|{{ (1, 2) ~ '' }}|{{ {'a': (1,)} | tojson }}",
     "x,y|<Namespace {'l': ['x', 'y']}>|(1, 2)|{\"a\": [1]}"),
])
def test_ordinary_use_renders_as_before(source: str, expected: str) -> None:
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    assert ChatTemplate(source).render(messages, add_generation_prompt=False) == expected


def test_every_method_and_filter_has_a_rule() -> None:
    """A str, bytes, int, float, list, tuple or dict method (or a filter) not in a table is refused,
    so the tables must name every one a template can reach; each public method is named."""
    from jinja2.filters import FILTERS as JINJA_FILTERS

    from backends.chat.render_budget import (
        DICT_METHODS,
        FILTERS,
        INT_METHODS,
        SEQUENCE_METHODS,
        STR_METHODS,
    )

    mutating = {"append", "clear", "extend", "insert", "pop", "remove", "reverse", "sort", "popitem",
                "setdefault", "update"}  # refused by the immutable sandbox before any table
    tables: list[tuple[tuple[type, ...], dict[str, Any]]] = [
        ((str, bytes), STR_METHODS), ((int, float), INT_METHODS), ((list, tuple), SEQUENCE_METHODS),
        ((dict, type({}.keys())), DICT_METHODS)]
    for kinds, table in tables:
        public = {m for k in kinds for m in dir(k) if not m.startswith("_")} - mutating
        attributes = {"real", "imag", "numerator", "denominator", "mapping"}
        assert public - attributes <= set(table), (kinds, sorted(public - attributes - set(table)))
    assert set(JINJA_FILTERS) <= set(FILTERS), sorted(set(JINJA_FILTERS) - set(FILTERS))


def test_an_unlisted_method_is_refused() -> None:
    """One a later Python adds (the sandbox lets no underscored name through: one stands in here)."""
    from jinja2.sandbox import SecurityError

    from backends.chat.render_budget import method_rule

    assert method_rule("x".upper) == ("upper", None)
    assert method_rule(ChatTemplate) is None  # not a builtin type's method: counted as a call
    with pytest.raises(SecurityError, match="not available"):
        method_rule("x".__sizeof__)


@settings(max_examples=60, deadline=None)
@given(method=st.sampled_from(["ljust", "rjust", "center", "zfill", "expandtabs"]),
       text=st.text(alphabet=string.ascii_letters + "\t\n", max_size=20),
       width=st.integers(min_value=-10, max_value=10**12))
def test_a_sized_method_either_fits_or_is_refused_before(method: str, text: str, width: int) -> None:
    """Whatever the width: a result within the limit, or a limit error, at once (never the string)."""
    from backends.chat.render_budget import MAX_OUTPUT_CHARS

    tpl = ChatTemplate("{{ t." + method + "(w) | length }}")
    started = time.process_time()
    try:
        n = int(tpl.render(USER, extra={"t": text, "w": width}))
    except TemplateError as e:  # the budget's refusal, or Python's own for a width past a C int
        assert "longer than" in str(e) or "OverflowError" in str(e), str(e)
    else:
        assert n <= MAX_OUTPUT_CHARS
    assert time.process_time() - started < SECONDS
