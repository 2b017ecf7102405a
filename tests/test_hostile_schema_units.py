"""The structured-output schema limits (backends/contract/schema_limits.py), without Redis or a
model: what a producer's request validation refuses, with which words, and what still passes."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from backends.contract.schema import GenerateRequest, describe_validation_error

STRING: dict[str, Any] = {"type": "string"}


def refusal(schema: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as e:
        GenerateRequest(prompt="x", format=schema)
    return describe_validation_error(e.value)


def nested_arrays(depth: int, **kw: Any) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "string", "maxLength": 4}
    for _ in range(depth):
        s = {"type": "array", "items": s, **kw}
    return s


@pytest.mark.parametrize("key", ["maxLength", "minLength", "maxItems", "minItems"])
def test_a_repetition_count_over_the_limit_is_refused_naming_keyword_and_limit(key: str) -> None:
    kind = "string" if key.endswith("Length") else "array"
    schema = {"type": kind, key: 20000, **({"items": STRING} if kind == "array" else {})}
    assert refusal(schema) == (f"format: {key} 20000 exceeds the limit of 1000 (at the root; each item "
                               f"becomes a copy or a nested group in the grammar)")
    GenerateRequest(prompt="x", format={**schema, key: 1000})  # the limit itself passes


def test_counts_are_found_wherever_the_converter_looks() -> None:
    """Inside properties, items, anyOf, $defs, and behind a $ref to any place in the document."""
    big = {"type": "string", "maxLength": 100_000}
    where: dict[str, dict[str, Any]] = {
        "/properties/a/items": {"type": "object", "properties": {"a": {"type": "array", "items": big}}},
        "/anyOf/1": {"anyOf": [STRING, big]},
        "/$defs/x": {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "$defs": {"x": big}},
        "#/hidden/deep": {"type": "object", "properties": {"a": {"$ref": "#/hidden/deep"}},
                          "hidden": {"deep": big}},
    }
    for path, schema in where.items():
        assert f"maxLength 100000 exceeds the limit of 1000 (at {path};" in refusal(schema), path


def test_pattern_quantifiers_length_and_nesting() -> None:
    def pattern(p: str) -> dict[str, Any]:
        return {"type": "string", "pattern": p}

    assert "the quantifier {0,20000} repeats 20,000 times" in refusal(pattern("^a{0,20000}$"))
    assert "{100000000}" in refusal(pattern("^a{100000000}$"))  # a 100 MB literal
    assert "{1_000_000}" in refusal(pattern("^a{1_000_000}$"))  # int() reads "1_000_000"
    assert "characters long; the limit is 1,000" in refusal(pattern("^" + "a" * 2000 + "$"))
    deep = "^" + "(" * 100 + "a" + ")" * 100 + "$"
    assert "nests groups deeper than the limit of 64" in refusal({"type": "string", "pattern": deep})
    keyed = {"type": "object", "patternProperties": {"^" + "(" * 300 + "a" + ")" * 300 + "$": STRING}}
    assert "nests groups deeper" in refusal(keyed)  # jsonschema would hit RecursionError compiling it
    for fine in ("^[a-z]{2,8}@[a-z]+\\.com$", "^(ab){0,1000}$", "^((a{0,500}){0,500})$", "^\\{[0-9]{3}\\}$"):
        GenerateRequest(prompt="x", format={"type": "string", "pattern": fine})


def test_nesting_alternatives_properties() -> None:
    assert "nests deeper than the limit of 64 levels" in refusal(nested_arrays(70))
    GenerateRequest(prompt="x", format=nested_arrays(60))
    too_many = {"anyOf": [{"const": i} for i in range(513)]}
    why = refusal(too_many)
    assert "513 alternatives (enum values, anyOf/oneOf branches, type lists); the limit is 512" in why
    props = {"type": "object", "properties": {f"p{i}": STRING for i in range(300)}}
    assert "properties has 300 entries; the limit is 256" in refusal(props)


def test_nested_minimums_multiply_into_the_shortest_output() -> None:
    """3 levels of minItems 100 need >= 100^3 items: no max_tokens can ever finish such a text."""
    why = refusal(nested_arrays(3, minItems=100))
    assert "requires at least" in why and "minItems/minLength multiply when nested" in why
    GenerateRequest(prompt="x", format=nested_arrays(2, minItems=100))  # 10,000 items' worth passes


def test_the_grammar_estimate_bounds_many_moderate_counts() -> None:
    """Each count under its limit, together a grammar far over MAX_GRAMMAR_CHARS."""
    props = {f"field_with_a_rather_long_name_{i}": {"type": "array", "items": STRING, "maxItems": 1000}
             for i in range(40)}
    assert "the schema's grammar would be about" in refusal({"type": "object", "properties": props})


def test_malformed_values_leave_the_refusal_to_json_schema() -> None:
    """Non-numbers, NaN and infinity never slip past the limits as 'small'."""
    assert "not a valid JSON schema" in refusal({"type": "string", "maxLength": "many"})
    assert "exceeds the limit" in refusal({"type": "string", "maxLength": float("inf")})
    assert "exceeds the limit" in refusal({"type": "string", "maxLength": float("nan")})


def test_a_deep_document_is_refused_before_any_recursive_check() -> None:
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(5000):  # json.dumps and jsonschema would raise RecursionError on this
        node["not"] = {}
        node = node["not"]
    assert "nests deeper than the limit of 64 levels" in refusal(deep)


def test_a_schema_that_reaches_itself_before_any_text_is_refused() -> None:
    """Left recursion through $ref/anyOf: no grammar (llama.cpp refuses it at compile time, on
    the worker); recursion inside an object's property is fine."""
    loop = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    assert "refers to itself through $ref #/$defs/a before any JSON is written" in refusal(loop)
    via_any = {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
               "$defs": {"a": {"anyOf": [STRING, {"$ref": "#/$defs/a"}]}}}
    assert "refers to itself through $ref" in refusal(via_any)
    kids = {"type": "array", "items": {"$ref": "#/$defs/node"}}
    tree = {"type": "object", "properties": {"root": {"$ref": "#/$defs/node"}},
            "$defs": {"node": {"type": "object", "properties": {"kids": kids}}}}
    GenerateRequest(prompt="x", format=tree)
