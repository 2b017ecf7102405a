"""Agent frameworks on the gateway's tool calls, against the shared real fleet (`fleet serve` on a
real worker and the real model): LangChain (`langchain-openai`: bind_tools and an agent loop over
two tools, with_structured_output through a function call) and instructor in its default TOOLS
mode."""

from __future__ import annotations

import instructor
import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

pytestmark = [pytest.mark.timeout(300), pytest.mark.model]


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=120)


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"18 degrees and sunny in {city}"


@tool
def get_time(timezone: str) -> str:
    """The local time in a timezone."""
    return f"It is 14:05 in {timezone}"


def test_langchain_agent_loop_structured_output_and_instructor(real_fleet) -> None:
    gw = real_fleet
    llm = ChatOpenAI(model="llm", base_url=f"{gw.url}/v1", api_key="unused", temperature=0, max_tokens=64,
                     max_retries=0)

    # an agent loop: the model calls tools, their results go back as ToolMessages, until it has
    # made two calls; then it answers (tool_choice none: the small model keeps calling otherwise)
    tools = {"get_weather": get_weather, "get_time": get_time}
    agent = llm.bind_tools(list(tools.values()), tool_choice="required")
    messages: list = [HumanMessage("What is the weather in Paris, and what time is it there?")]
    called = []
    while len(called) < 2:
        ai = agent.invoke(messages)
        assert isinstance(ai, AIMessage) and ai.tool_calls and not ai.invalid_tool_calls
        messages.append(ai)
        for call in ai.tool_calls:
            chosen = tools[call["name"]]
            result = chosen.invoke(call["args"])  # LangChain checks the arguments against the tool's schema
            called.append(call["name"])
            messages.append(ToolMessage(result, tool_call_id=call["id"]))
    answer = llm.bind_tools(list(tools.values()), tool_choice="none").invoke(messages)
    assert isinstance(answer, AIMessage) and answer.content and not answer.tool_calls
    assert len(called) == 2

    # with_structured_output through a function call: a Person, validated by pydantic
    person = llm.with_structured_output(Person, method="function_calling").invoke(
        "Invent a person with a name and an age.")
    assert isinstance(person, Person) and person.name

    # instructor's default mode (TOOLS): the same through a forced function call
    client = instructor.from_openai(openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0),
                                    mode=instructor.Mode.TOOLS)
    extracted = client.chat.completions.create(
        model="llm", response_model=Person, max_retries=0, max_tokens=64, temperature=0,
        messages=[{"role": "user", "content": "Extract the person: Ada Lovelace was 36 years old."}])
    assert isinstance(extracted, Person) and extracted.name and 0 <= extracted.age <= 120
