"""The stateless Responses API (POST /v1/responses) through the official openai SDK against the
shared real fleet (`fleet serve` on a real worker and the real model): text, a function call, a
call's output back, streaming events in the documented order, and what a stateless gateway
refuses."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.test_gateway_tools import schema_of

pytestmark = [pytest.mark.timeout(300), pytest.mark.model]
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": schema_of("get_weather")}


def test_responses_text_calls_stream_and_refusals(real_fleet) -> None:
    gw = real_fleet
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)

    text = client.responses.create(model="llm", input="Once upon a time", instructions="Tell a story.",
                                   max_output_tokens=16, temperature=0)
    assert text.object == "response" and text.output_text and text.output[0].type == "message"
    assert text.status == "incomplete" and text.incomplete_details.reason == "max_output_tokens"
    assert text.usage is not None and text.usage.output_tokens == 16 and text.usage.input_tokens > 0

    # a function call, then its output back as input items, answered
    ask = [{"role": "user", "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]}]
    called = client.responses.create(model="llm", input=ask, tools=[WEATHER], tool_choice="required",
                                     parallel_tool_calls=False, max_output_tokens=64, temperature=0)
    assert called.status == "completed" and [o.type for o in called.output] == ["function_call"]
    call = called.output[0]
    jsonschema.validate(json.loads(call.arguments), schema_of("get_weather"))
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    answered = client.responses.create(model="llm", tools=[WEATHER], tool_choice="none", max_output_tokens=16,
                                       temperature=0, input=[
                                           *ask, {"type": "function_call", "call_id": call.call_id,
                                                  "name": call.name, "arguments": call.arguments},
                                           {"type": "function_call_output", "call_id": call.call_id,
                                            "output": "18 degrees and sunny"}])
    assert answered.output_text and answered.usage.input_tokens > called.usage.input_tokens - 60

    # streamed text: the documented events in order, deltas joined = the final text (cut by
    # max_output_tokens: it ends incomplete, as OpenAI's)
    events = list(client.responses.create(model="llm", input="Once upon a time", max_output_tokens=16,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    joined = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert joined == events[-4].text == events[-1].response.output_text

    # a streamed call: its item, its arguments, then completed
    streamed = list(client.responses.create(model="llm", input=ask, tools=[WEATHER], tool_choice="required",
                                            parallel_tool_calls=False, max_output_tokens=64, temperature=0,
                                            stream=True))
    kinds = [e.type for e in streamed]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    done = streamed[-1].response.output[0]
    assert done.type == "function_call" and streamed[4].arguments == done.arguments
    jsonschema.validate(json.loads(done.arguments), schema_of("get_weather"))

    # a stateless gateway: what needs stored responses is a clear 400
    for body, words in (({"previous_response_id": "resp_1"}, "not stored"),
                        ({"background": True}, "stored responses"),
                        ({"tools": [{"type": "web_search"}]}, "only function tools"),
                        ({"reasoning": {"effort": "extreme"}}, "must be one of minimal, low, medium, high"),
                        ({"input": [{"type": "image", "url": "x"}]}, "input[0]")):
        response = httpx.post(f"{gw.url}/v1/responses", json={"model": "llm", "input": "hi", **body},
                              timeout=30)
        assert response.status_code == 400 and words in response.json()["error"]["message"], response.text
