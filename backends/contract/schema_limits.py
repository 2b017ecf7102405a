"""Bounds on a structured-output JSON schema, checked where producers and workers both see it
(`GenerateRequest` validation), before any grammar is built. Pure Python: no llama_cpp.

A worker turns the schema into a GBNF grammar (backends/llamacpp/schema_grammar.py) and llama.cpp
compiles it with a recursive-descent parser. Each `maxLength`/`maxItems` item beyond the minimum
becomes one more nested optional group, so a large count overflows the C stack and kills the
worker (SIGSEGV: no Python frame is left to catch it); `minLength`/`minItems` and a pattern's
`{m,n}` copy their item that many times. This module walks the schema the way the converter does
(following its local `$ref`s) and refuses, naming the keyword, where and the limit, whatever
could blow up: counts, nesting, patterns, alternatives, an estimate of the grammar's size and the
shortest output the schema allows. The limits and how they were measured: docs/reliability.md,
"Structured output limits".
"""

from __future__ import annotations

import json
import math
from typing import Any

# Each limit keeps a wide margin to what was measured to break (docs/reliability.md).
MAX_REPEAT = 1000  # minLength, maxLength, minItems, maxItems, a pattern's {m,n}
MAX_NESTING = 64  # levels of the schema document, and of groups in a pattern
MAX_PATTERN_CHARS = 1000  # one `pattern`
MAX_ALTERNATIVES = 512  # enum values + anyOf/oneOf branches + type lists, whole schema
MAX_PROPERTIES = 256  # one object's properties (the converter recurses once per optional one)
MAX_GRAMMAR_CHARS = 262_144  # the grammar's size, estimated here and checked again once built
# The shortest text the schema allows: 8,192 tokens (the largest max_tokens) at 4 characters each;
# JSON averages fewer, so a schema needing more can never be finished
MAX_OUTPUT_CHARS = 32_768

REPEAT_KEYS = ("minLength", "maxLength", "minItems", "maxItems")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
SCHEMA_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains",
              "propertyNames", "additionalItems", "unevaluatedItems", "unevaluatedProperties")
RULE_OVERHEAD = 48  # characters a rule costs beyond its name: "::=", spaces, "space", quotes


class SchemaTooComplex(ValueError):
    """The schema passes JSON Schema's rules but would make a grammar too big to compile safely."""


def check_depth(doc: Any) -> None:
    """Refuse a document nested deeper than MAX_NESTING (iteratively: a deep one would otherwise
    hit Python's recursion limit in the validators)."""
    todo: list[tuple[Any, int]] = [(doc, 1)]
    while todo:
        node, depth = todo.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > MAX_NESTING:
                    raise SchemaTooComplex(f"the schema nests deeper than the limit of {MAX_NESTING} levels")
                todo.append((child, depth + 1))


def check_schema_limits(schema: dict[str, Any]) -> None:
    """SchemaTooComplex naming the first keyword over its limit (call check_depth first)."""
    walk = _Walk(schema)
    walk.run()
    if walk.alternatives > MAX_ALTERNATIVES:
        raise SchemaTooComplex(f"the schema has {walk.alternatives:,} alternatives (enum values, anyOf/"
                               f"oneOf branches, type lists); the limit is {MAX_ALTERNATIVES:,}")
    if walk.size > MAX_GRAMMAR_CHARS:
        raise SchemaTooComplex(f"the schema's grammar would be about {walk.size:,} characters; the limit "
                               f"is {MAX_GRAMMAR_CHARS:,} (lower maxLength/maxItems/minItems or split it)")
    _check_ref_cycles(schema, walk.nodes)
    shortest = _Shortest(schema).chars(schema, 0)
    if shortest == math.inf:
        raise SchemaTooComplex("no finite JSON satisfies the schema: a $ref requires itself (through "
                               "required properties, minItems or allOf) with no way out, so an answer "
                               "could only stop at max_tokens, unfinished")
    if shortest > MAX_OUTPUT_CHARS:
        raise SchemaTooComplex(f"the schema requires at least {shortest:,} characters of output (minItems/"
                               f"minLength multiply when nested); the limit is {MAX_OUTPUT_CHARS:,}")


def resolve_ref(root: dict[str, Any], ref: Any) -> Any:
    """The target of a local `$ref` as the converter resolves it ('#/a/b': keys, no unescaping);
    None for anything it would refuse itself (remote, malformed, missing)."""
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return None
    target: Any = root
    for sel in ref.split("#")[-1].split("/")[1:]:
        if not isinstance(target, dict) or sel not in target:
            return None
        target = target[sel]
    return target


class _Walk:
    """Every subschema the converter may visit, each once; counts and a size estimate."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.alternatives = 0
        self.size = 0
        self.seen: set[int] = set()
        self.nodes: list[dict[str, Any]] = []

    def run(self) -> None:
        todo: list[tuple[Any, str, int]] = [(self.root, "", 4)]  # node, where, length of its rule name
        while todo:
            node, where, name = todo.pop()
            if not isinstance(node, dict) or id(node) in self.seen:
                continue
            self.seen.add(id(node))
            self.nodes.append(node)
            self.size += name + RULE_OVERHEAD
            self._counts(node, where, name)
            todo.extend(self._children(node, where, name))

    def _counts(self, node: dict[str, Any], where: str, name: int) -> None:
        for key in REPEAT_KEYS:
            if key in node:
                n = _count(node[key], key, where)
                # a string repeats the 4-character `char` rule; an array its item's rule and ", "
                unit = 10 if key.endswith("Length") else name + 24
                self.size += n * unit
        if isinstance(node.get("pattern"), str):
            self.size += check_pattern(node["pattern"], f"{where}/pattern", name)
        if isinstance(node.get("patternProperties"), dict):  # its keys are regexes too
            for key in node["patternProperties"]:
                check_pattern(key, f"{where}/patternProperties", name)
        for key in ("enum", "const"):
            if key in node:
                values = node[key] if key == "enum" and isinstance(node[key], list) else [node[key]]
                self.alternatives += len(values) if key == "enum" else 0
                self.size += sum(len(json.dumps(v)) * 2 + 4 for v in values)  # escaped literals
        for key in ("anyOf", "oneOf", "type"):
            if isinstance(node.get(key), list):
                self.alternatives += len(node[key])
        props = node.get("properties")
        if isinstance(props, dict) and len(props) > MAX_PROPERTIES:
            raise SchemaTooComplex(f"{_at(where)}properties has {len(props)} entries; the limit is "
                                   f"{MAX_PROPERTIES}")
        if isinstance(props, dict):  # each optional one adds a `-rest` rule naming the next
            self.size += sum(3 * (name + len(k)) + RULE_OVERHEAD for k in props)

    def _children(self, node: dict[str, Any], where: str, name: int) -> list[tuple[Any, str, int]]:
        out: list[tuple[Any, str, int]] = []
        for key in SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                out += [(v, f"{where}/{key}/{k}", name + len(k) + 1) for k, v in node[key].items()]
        for key in SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                out += [(v, f"{where}/{key}/{i}", name + len(key) + 8) for i, v in enumerate(node[key])]
        for key in SCHEMA_ONE:
            if isinstance(node.get(key), dict):
                out.append((node[key], f"{where}/{key}", name + len(key) + 8))
        if "$ref" in node:
            target = resolve_ref(self.root, node["$ref"])
            out.append((target, str(node["$ref"]), len(str(node["$ref"]).rsplit("/", 1)[-1]) + 1))
        return out


def _check_ref_cycles(root: dict[str, Any], nodes: list[dict[str, Any]]) -> None:
    """Refuse a schema that reaches itself through `$ref`/`anyOf`/`oneOf` before any character is
    written (`{"$ref": "#/$defs/a"}` with a = itself): its grammar would be left-recursive."""
    def firsts(node: dict[str, Any]) -> list[Any]:
        out = [resolve_ref(root, node["$ref"])] if "$ref" in node else []
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                out += node[key]
        return [n for n in out if isinstance(n, dict)]

    done: set[int] = set()
    for start in nodes:
        if id(start) in done:
            continue
        path: dict[int, str] = {}  # an iterative depth-first search, the current path in `path`
        stack: list[tuple[dict[str, Any], int]] = [(start, 0)]
        while stack:
            node, i = stack.pop()
            nexts = firsts(node)
            if i == 0:
                path[id(node)] = str(node.get("$ref", ""))
            if i < len(nexts):
                stack.append((node, i + 1))
                child = nexts[i]
                if id(child) in path:
                    ref = next((r for r in path.values() if r), "")
                    raise SchemaTooComplex(f"the schema refers to itself through $ref {ref} before "
                                           f"any JSON is written: no grammar can express it")
                if id(child) not in done:
                    stack.append((child, 0))
            else:
                path.pop(id(node), None)
                done.add(id(node))


class _Shortest:
    """The fewest characters of JSON a schema allows (as far as the converter enforces it); inf
    when none is finite: a node that requires itself again along every way out."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.resolving: set[int] = set()

    def chars(self, node: Any, depth: int) -> float:
        if id(node) in self.resolving:
            return math.inf  # required again inside itself: this way never ends
        if not isinstance(node, dict) or depth > 4 * MAX_NESTING:
            return 0  # a very long chain of refs: counted as free (never over-refuse)
        self.resolving.add(id(node))
        try:
            found = self._chars(node, depth + 1)
            return found if found == math.inf else min(found, MAX_OUTPUT_CHARS + 1)
        finally:
            self.resolving.discard(id(node))

    def _chars(self, node: dict[str, Any], depth: int) -> float:
        if "$ref" in node:
            return self.chars(resolve_ref(self.root, node["$ref"]), depth)
        for key in ("oneOf", "anyOf"):
            if isinstance(node.get(key), list) and node[key]:
                return min(self.chars(alt, depth) for alt in node[key])
        if "const" in node:
            return len(json.dumps(node["const"]))
        if isinstance(node.get("enum"), list) and node["enum"]:
            return min(len(json.dumps(v)) for v in node["enum"])
        if isinstance(node.get("allOf"), list):
            return sum(self.chars(part, depth) for part in node["allOf"])
        kind = node.get("type")
        if kind == "string" or (kind is None and ("minLength" in node or "pattern" in node)):
            return 2 + _num(node.get("minLength"))
        if kind == "array" or (kind is None and ("items" in node or "minItems" in node)):
            items = node.get("items")
            each = self.chars(items, depth) if isinstance(items, dict) else 1
            if isinstance(node.get("prefixItems"), list):
                return 2 + sum(self.chars(i, depth) + 1 for i in node["prefixItems"])
            return 2 + _num(node.get("minItems")) * (each + 1)
        props = node.get("properties")
        required = node.get("required")
        if isinstance(props, dict) and isinstance(required, list):
            return 2 + sum(len(json.dumps(k)) + 2 + self.chars(props.get(k), depth)
                           for k in required if isinstance(k, str) and k in props)
        return 1


def check_pattern(pattern: str, where: str, name: int = 4) -> int:
    """Check one `pattern` as the converter reads it; returns an estimate of its grammar's size."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise SchemaTooComplex(f"{where} is {len(pattern):,} characters long; the limit is "
                               f"{MAX_PATTERN_CHARS:,}")
    size, depth, i, prev = len(pattern) * 2, 0, 0, 1  # prev: grammar length of the item before
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i, prev = i + 2, 2
            continue
        if c == "[":  # a class: to its closing bracket, escapes included
            j = i + 1
            while j < len(pattern) and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i, prev = j + 1, name + 8  # a quantified class becomes a rule of its own
            continue
        if c == "(":
            depth += 1
            if depth > MAX_NESTING:
                raise SchemaTooComplex(f"{where} nests groups deeper than the limit of {MAX_NESTING}")
        elif c == ")":
            depth -= 1
            prev = name + 8  # a quantified group becomes a rule of its own
        elif c == "{":
            end = pattern.find("}", i)
            if end < 0:
                break  # the converter refuses it itself
            most = _quantifier(pattern[i + 1:end], where)
            size += most * (prev + 8)
            i = end + 1
            continue
        elif c not in "|*+?.":
            prev = 3
        i += 1
    return size


def _quantifier(inner: str, where: str) -> int:
    """The largest count in a {m} / {m,} / {m,n} quantifier, read with the converter's int()."""
    most = 0
    for part in inner.split(","):
        try:
            n = int(part.strip()) if part.strip() else 0
        except ValueError:
            return 0  # the converter refuses it itself
        if n > MAX_REPEAT:
            raise SchemaTooComplex(f"{where}: the quantifier {{{inner}}} repeats {n:,} times; the "
                                   f"limit is {MAX_REPEAT:,}")
        most = max(most, n)
    return most


def _count(value: Any, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0  # JSON Schema's own check refuses it
    if not math.isfinite(value) or value > MAX_REPEAT:
        raise SchemaTooComplex(f"{key} {value} exceeds the limit of {MAX_REPEAT} (at {where or 'the root'}; "
                               f"each item becomes a copy or a nested group in the grammar)")
    return int(value)


def _num(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else 0


def _at(where: str) -> str:
    return f"{where}: " if where else ""
