"""JSON Schema -> GBNF for structured output: llama-cpp-python's converter, plus integer bounds.

The converter shipped with llama-cpp-python ignores `minimum`/`maximum` (an "age" of 0..120 could
come out as 1255). Bounded integers here become a grammar of digit ranges: [lo, hi] is split by
digit count, and each same-length range into a prefix plus digit classes, e.g. 0..120 ->
[0-9] | [1-9] [0-9] | "1" [0-1] [0-9] | "1" "2" [0-0]. Bounds on `number` (floats) are not enforced.
"""

from __future__ import annotations

import json
import math
from typing import Any

from llama_cpp.llama_grammar import RESERVED_NAMES, SchemaConverter

MAX_DIGITS = 16  # the converter's own limit for an integer's digits
BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def json_schema_to_gbnf(schema: str) -> str:
    converter = _BoundedIntegers(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    resolved = converter.resolve_refs(json.loads(schema), "stdin")
    converter.visit(resolved, "")
    return str(converter.format_grammar())


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
