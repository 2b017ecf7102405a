"""JSON Schema -> GBNF for structured output: llama-cpp-python's converter, plus integer bounds,
and the checks that keep a grammar within what llama.cpp compiles safely.

The converter shipped with llama-cpp-python ignores `minimum`/`maximum` (an "age" of 0..120 could
come out as 1255). Bounded integers here become a grammar of digit ranges: [lo, hi] is split by
digit count, and each same-length range into a prefix plus digit classes, e.g. 0..120 ->
[0-9] | [1-9] [0-9] | "1" [0-1] [0-9] | "1" "2" [0-0]. Bounds on `number` (floats) are not enforced.

llama.cpp parses a grammar recursively, one C stack frame pair (~440 bytes) per nested group:
the converter writes `maxLength: n` as n nested optional groups, and a 20,000-deep grammar
overflows an 8 MiB stack (SIGSEGV, the worker dies). The schema's limits (contract
schema_limits) keep the converter's input small; `check_gbnf` checks what it produced, before
llama.cpp sees it (docs/reliability.md, "Structured output limits").
"""

from __future__ import annotations

import json
import math
from typing import Any

from llama_cpp.llama_grammar import RESERVED_NAMES, SchemaConverter

from backends.contract.schema_limits import MAX_GRAMMAR_CHARS, MAX_REPEAT, check_depth, check_schema_limits

MAX_DIGITS = 16  # the converter's own limit for an integer's digits
BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# Deepest group nesting in one rule: a schema within its limits nests at most MAX_REPEAT groups
# (repetition) plus a pattern's own groups; llama.cpp refuses repetition deeper than ~1,000 itself
MAX_GRAMMAR_NESTING = MAX_REPEAT + 64
MAX_GRAMMAR_RULES = 8192


class GrammarTooLarge(ValueError):
    """The grammar is bigger or deeper than llama.cpp is given to compile."""


def json_schema_to_gbnf(schema: str) -> str:
    doc = json.loads(schema)
    if isinstance(doc, dict):  # the request's validation ran these already, unless it was bypassed
        check_depth(doc)
        check_schema_limits(doc)
    converter = _BoundedIntegers(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    resolved = converter.resolve_refs(doc, "stdin")
    converter.visit(resolved, "")
    gbnf = str(converter.format_grammar())
    check_gbnf(gbnf)
    return gbnf


def check_gbnf(gbnf: str) -> None:
    """GrammarTooLarge unless the grammar's size, rule count, group nesting and `{m,n}` counts are
    within the limits (literals, character classes and comments are skipped: their brackets are
    text; a rule may span lines, as in llama.cpp's JSON grammar)."""
    if len(gbnf) > MAX_GRAMMAR_CHARS:
        raise GrammarTooLarge(f"the grammar is {len(gbnf):,} characters; the limit is {MAX_GRAMMAR_CHARS:,}")
    rules = gbnf.count("::=")
    if rules > MAX_GRAMMAR_RULES:
        raise GrammarTooLarge(f"the grammar has {rules:,} rules; the limit is {MAX_GRAMMAR_RULES:,}")
    depth = deepest = i = 0
    n = len(gbnf)
    while i < n:
        c = gbnf[i]
        if c == '"' or c == "[":  # a literal or a class, to its unescaped end
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and gbnf[i] != close:
                i += 2 if gbnf[i] == "\\" else 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        elif c == "#":  # a comment, to the end of its line
            while i < n and gbnf[i] != "\n":
                i += 1
        elif c == "{":
            end = gbnf.find("}", i)
            counts = gbnf[i + 1:end].split(",") if end > 0 else []
            if any(p.strip().isascii() and p.strip().isdigit() and int(p) > MAX_REPEAT for p in counts):
                raise GrammarTooLarge(f"the grammar repeats {gbnf[i:end + 1]}; the limit is {MAX_REPEAT:,}")
        i += 1
    if deepest > MAX_GRAMMAR_NESTING:
        raise GrammarTooLarge(f"the grammar nests {deepest:,} groups deep; the limit is "
                              f"{MAX_GRAMMAR_NESTING:,}")


class _BoundedIntegers(SchemaConverter):
    def visit(self, schema: dict[str, Any], name: str) -> str:
        plain = not any(k in schema for k in ("$ref", "oneOf", "anyOf", "const", "enum"))
        if plain and schema.get("type") == "integer" and any(k in schema for k in BOUND_KEYS):
            rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
            lo, hi = integer_bounds(schema)
            return str(self._add_rule(rule_name, f"({' | '.join(integer_range(lo, hi))}) space"))
        return str(super().visit(schema, name))


def integer_bounds(schema: dict[str, Any]) -> tuple[int, int]:
    biggest = 10**MAX_DIGITS - 1
    lo, hi = -biggest, biggest
    if "minimum" in schema:
        lo = max(lo, math.ceil(schema["minimum"]))
    if "exclusiveMinimum" in schema:
        lo = max(lo, math.floor(schema["exclusiveMinimum"]) + 1)
    if "maximum" in schema:
        hi = min(hi, math.floor(schema["maximum"]))
    if "exclusiveMaximum" in schema:
        hi = min(hi, math.ceil(schema["exclusiveMaximum"]) - 1)
    if lo > hi:
        raise ValueError(f"no integer lies within the bounds of {json.dumps(schema)}")
    return lo, hi


def integer_range(lo: int, hi: int) -> list[str]:
    """GBNF alternatives matching exactly the decimal integers lo..hi (no leading zeros)."""
    alts: list[str] = []
    if lo < 0:  # the negative part, as "-" and its magnitude
        alts += [f'"-" {alt}' for alt in integer_range(max(1, -hi), -lo)]
        if hi < 0:
            return alts
        lo = 0
    for digits in range(len(str(lo)), len(str(hi)) + 1):
        start = max(lo, 10 ** (digits - 1) if digits > 1 else 0)
        end = min(hi, 10**digits - 1)
        if start <= end:
            alts += _same_length(str(start), str(end))
    return alts


def _same_length(a: str, b: str) -> list[str]:
    """Alternatives for the numbers a..b, both written with the same number of digits."""
    if len(a) == 1:
        return [f"[{a}-{b}]"]
    if a[0] == b[0]:
        return [f'"{a[0]}" {alt}' for alt in _same_length(a[1:], b[1:])]
    rest = len(a) - 1
    any_rest = " ".join(["[0-9]"] * rest)
    alts: list[str] = []
    first, last = int(a[0]), int(b[0])
    if a[1:] != "0" * rest:  # a's own leading digit covers only a's tail up to 99..9
        alts += [f'"{a[0]}" {alt}' for alt in _same_length(a[1:], "9" * rest)]
        first += 1
    tail_b = b[1:] != "9" * rest
    if tail_b:
        last -= 1
    if first <= last:
        alts.append(f"[{first}-{last}] {any_rest}")
    if tail_b:
        alts += [f'"{b[0]}" {alt}' for alt in _same_length("0" * rest, b[1:])]
    return alts
