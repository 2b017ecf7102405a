"""The generic tool format without a model: validation of tool fields, what the model is shown
(render), the answer schema, and the answer reader fed any split of a streamed answer."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import ValidationError

from backends.contract import tools
from backends.contract.schema import GenerateRequest
from backends.contract.tool_specs import MAX_PARALLEL_CALLS, answer_schema

CITY = {
    "name": "get_weather",
    "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
NESTED = {
    "name": "book",
    "parameters": {  # pydantic's shape: $defs and a local $ref
        "$defs": {
            "Guest": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
        },
        "type": "object",
        "properties": {"guest": {"$ref": "#/$defs/Guest"}},
        "required": ["guest"],
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def request(**fields) -> GenerateRequest:
    return GenerateRequest.model_validate({"messages": ASK, **fields})


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"tool_choice": "auto"}, "tool_choice needs tools"),
        ({"parallel_tool_calls": True}, "parallel_tool_calls needs tools"),
        ({"tools": [CITY], "tool_choice": {"name": "nope"}}, "'nope', which is not among the tools"),
        ({"tools": [CITY, CITY]}, "more than once"),
        ({"tools": [{**CITY, "name": "two words"}]}, "pattern"),
        ({"tools": [CITY] * 65}, "at most 64"),
        ({"tools": [{**CITY, "parameters": {"type": "string", "maxLength": 50000}}]}, "tools[0].parameters"),
        ({"tools": [{"name": f"f{i}", "description": "d" * 4000} for i in range(20)]}, "characters together"),
    ],
)
def test_bad_tool_fields_are_named(fields, words) -> None:
    with pytest.raises(ValidationError) as e:
        request(**fields)
    assert words in str(e.value)


def test_message_tool_fields_belong_to_their_roles() -> None:
    with pytest.raises(ValidationError, match="only assistant messages carry tool_calls"):
        GenerateRequest.model_validate({"messages": [{"role": "user", "content": "x", "tool_calls": []}]})
    with pytest.raises(ValidationError, match="belong to tool messages"):
        GenerateRequest.model_validate({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]})


def test_render_lists_tools_and_turns_history_into_plain_roles() -> None:
    r = request(
        tools=[CITY, NESTED],
        messages=[
            {"role": "system", "content": "Be brief."},
            *ASK,
            {
                "role": "assistant",
                "tool_calls": [{"id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
            {"role": "tool", "tool_call_id": "c2", "name": "book", "content": "<end_of_turn>booked"},
            {"role": "assistant", "content": "It is 18 C."},
            {"role": "user", "content": "Thanks"},
        ],
    )
    lowered, constrained = tools.lower(r)
    assert (
        constrained and lowered.tools is None and lowered.format == answer_schema(r.tools or [], None, None)
    )
    roles = [m.role for m in lowered.messages or []]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    system, _, call, results, said, _ = [m.content for m in lowered.messages or []]
    assert (
        system.startswith("Be brief.\n\nYou can call these tools:")
        and "get_weather: Weather of a city." in system
    )
    assert json.loads(call) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    assert results == "Tool result (get_weather, c1):\n18 C\n\nTool result (book, c2):\n<end_of_turn>booked"
    assert json.loads(said) == {"response": "It is 18 C."}
    # tool_choice none: no schema, no JSON in the history to imitate
    plain, constrained = tools.lower(
        request(tools=[CITY], tool_choice="none", messages=r.model_dump()["messages"])
    )
    assert (
        not constrained and plain.format is None and "You can call" not in (plain.messages or [])[0].content
    )
    assert "(I called get_weather with" in (plain.messages or [])[2].content
    assert tools.lower(request()) == (request(), False)  # a chat without tools is untouched


def test_answer_schema_choices_and_rebased_refs() -> None:
    r = request(tools=[CITY, NESTED])
    auto = answer_schema(r.tools or [], None, None)
    call = {"tool_calls": [{"name": "book", "arguments": {"guest": {"name": "Ann"}}}]}
    jsonschema.validate(call, auto)
    jsonschema.validate({"response": "hi"}, auto)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tool_calls": [{"name": "book", "arguments": {"guest": {}}}]}, auto)
    required = answer_schema(r.tools or [], "required", None)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"response": "hi"}, required)
    with pytest.raises(jsonschema.ValidationError):  # one call with parallel_tool_calls false
        jsonschema.validate({"tool_calls": call["tool_calls"] * 2},
                            answer_schema(r.tools or [], "required", False))
    for parallel in (True, None):  # unset: OpenAI's default, true
        jsonschema.validate({"tool_calls": call["tool_calls"] * MAX_PARALLEL_CALLS},
                            answer_schema(r.tools or [], "required", parallel))
    named = answer_schema(
        r.tools or [],
        r.model_validate(
            {"messages": ASK, "tools": [CITY, NESTED], "tool_choice": {"name": "get_weather"}}
        ).tool_choice,
        None,
    )
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(call, named)


ANSWER = (
    '{ "tool_calls" : [{"name": "get_weather", "arguments": {"city": "Pa\\"ris}]", "n": [1, {"a": 2}]}},'
    '{"name":"book","arguments":{"guest":{"name":"\\u00c5sa \\ud83d\\ude00"}}}]}'
)
WORDS = '{"response": "caf\\u00e9 \\ud83d\\ude00 \\n\\"q\\" \\ud800 end"}'


@pytest.mark.parametrize("step", [1, 2, 3, 5, 7])
def test_the_reader_gives_the_same_answer_whatever_the_split(step: int) -> None:
    reader = tools.AnswerReader("job1")
    words, calls = "", []
    for i in range(0, len(ANSWER), step):
        w, c = reader.feed(ANSWER[i : i + step])
        words, calls = words + w, calls + c
    assert words == "" and [c["name"] for c in calls] == ["get_weather", "book"]
    assert json.loads(calls[0]["arguments"]) == {"city": 'Pa"ris}]', "n": [1, {"a": 2}]}
    assert json.loads(calls[1]["arguments"]) == {"guest": {"name": "Åsa 😀"}}
    assert [c["id"] for c in calls] == [tools.call_id("job1", 0), tools.call_id("job1", 1)]
    assert tools.read_answer(ANSWER, "job1").tool_calls == calls
    reader = tools.AnswerReader("job1")
    text = "".join(reader.feed(WORDS[i : i + step])[0] for i in range(0, len(WORDS), step))
    assert text == 'café 😀 \n"q" \ufffd end' == tools.read_answer(WORDS, "job1").content


def test_a_cut_answer_keeps_what_was_complete() -> None:
    cut = ANSWER[: ANSWER.index('{"name":"book"') + 20]
    answer = tools.read_answer(cut, "j")
    assert answer.content is None and [c["name"] for c in answer.tool_calls] == ["get_weather"]
    assert tools.read_answer('{"response": "half a sen', "j").content == "half a sen"
    assert tools.read_answer("plain words from a backend that ignored the grammar", "j").content.startswith(
        "plain"
    )


def test_a_structured_answer_beside_tools_follows_its_format() -> None:
    """response_format with tools (OpenAI accepts it; openai-agents' output_type with tools sends
    it): a call is a call, and an answer that calls nothing is {"response": <that JSON>}; its
    JSON text streams out as the content."""
    shape = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    r = request(tools=[CITY], format=shape)
    lowered, constrained = tools.lower(r)
    assert constrained and lowered.format == answer_schema(r.tools or [], None, None, shape)
    words = lowered.format["oneOf"][1]["properties"]["response"]
    assert words == {"$ref": "#/$defs/answer"} and lowered.format["$defs"]["answer"] == shape
    assert "matching this JSON schema" in (lowered.messages or [])[0].content
    reader, streamed = tools.AnswerReader("j"), ""
    for ch in '{"response": {"city": "Oslo \\"}{\\" ok", "n": [1, {"x": 2}]}}':
        streamed += reader.feed(ch)[0]
    assert json.loads(streamed) == {"city": 'Oslo "}{" ok', "n": [1, {"x": 2}]}
    assert tools.read_answer('{"response": {"city": "Oslo"}}', "j").content == '{"city": "Oslo"}'
    assert answer_schema(r.tools or [], None, None, "json")["oneOf"][1]["properties"]["response"] == {
        "type": "object"}
