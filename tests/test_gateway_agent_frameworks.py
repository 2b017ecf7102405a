"""Agent frameworks through the shared real fleet (`fleet serve`, a worker on the real model), each
completing a tool round trip: the model calls the tool, the framework runs it with arguments that
validate against the schema it sent, hands the result back, and the model's final answer comes
back.

- the OpenAI Agents SDK (`openai-agents`): an Agent with one function tool on the chat-completions
  model (OpenAIChatCompletionsModel) and the Responses model (OpenAIResponsesModel), each with
  Runner.run and Runner.run_streamed;
- pydantic-ai: an Agent with one tool on its OpenAI provider, run and run_stream;
- LangGraph: the prebuilt ReAct agent (create_react_agent) over langchain-openai's ChatOpenAI,
  invoked and streamed.

The model is a 270M one: each framework's own settings make the first turn call the tool
(tool_choice "required", which every one of them exposes) and the next one answer (the tool no
longer offered, or tool_choice "none"); left to `auto` the small model calls the tool again on
every turn. The openai-agents and pydantic-ai answers are structured (an output type: the
answer's JSON schema ends the answer when its value is complete); a plain answer from the small
model runs to max_tokens, and a Responses stream cut there ends `response.incomplete`, which
openai-agents raises as an error, as it would against OpenAI. Every request a framework sends
goes through an httpx hook that records it and its status: each must be a 200.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx2
import jsonschema
import pytest
from agents import (
    Agent,
    MessageOutputItem,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    ToolCallItem,
    ToolCallOutputItem,
    function_tool,
    set_tracing_disabled,
)
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent
from openai import AsyncOpenAI
from pydantic import BaseModel, Field
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai import NativeOutput
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import ToolCallPart, ToolReturnPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from tests.gateway_harness import GatewayProcess
from tests.real_fleet import RealFleet

pytestmark = [pytest.mark.timeout(400), pytest.mark.model]

QUESTION = "What is the weather in Paris?"
INSTRUCTIONS = "Answer questions about the weather."


def weather(city: str) -> str:
    return f"It is 18 degrees and sunny in {city}."


class Forecast(BaseModel):
    """The structured final answer (bounded, so the answer ends well within max_tokens)."""

    city: str = Field(max_length=30)
    weather: str = Field(max_length=60)


@pytest.fixture
def gateway(real_fleet: RealFleet) -> GatewayProcess:
    """The shared real fleet's `fleet serve` (its worker on the real model has 4 slots: a test's
    runs go at once)."""
    return real_fleet.gateway


@dataclass
class Recorder:
    """What a framework sent through its HTTP client: each request's JSON body and its answer's
    status (a failed answer's body too)."""

    sent: list[dict[str, Any]] = field(default_factory=list)
    answers: list[tuple[int, str]] = field(default_factory=list)

    def client(self) -> httpx2.AsyncClient:
        """An HTTP client for the framework's openai client (httpx2: what openai 3 uses by default)."""

        async def request(req: httpx2.Request) -> None:
            self.sent.append(json.loads(req.content))

        async def response(resp: httpx2.Response) -> None:
            text = ""
            if resp.status_code != 200:
                await resp.aread()
                text = resp.text
            self.answers.append((resp.status_code, text))

        return httpx2.AsyncClient(timeout=300, event_hooks={"request": [request], "response": [response]})

    def all_ok(self) -> None:
        assert self.answers and all(status == 200 for status, _ in self.answers), self.answers

    def schema_of(self, tool: str) -> dict[str, Any]:
        """The parameters schema the framework sent for `tool` (chat's nested shape or Responses' flat)."""
        for body in self.sent:
            for t in body.get("tools") or []:
                spec = t.get("function", t)
                if spec.get("name") == tool:
                    return spec["parameters"]
        raise AssertionError(f"no request offered {tool}: {self.sent}")

    def check_round_trip(self, args: dict[str, Any]) -> None:
        """Two requests, both answered 200: the first offers the tool with tool_choice required; the
        second carries the tool's result back; the call's arguments fit the schema sent."""
        self.all_ok()
        assert len(self.sent) == 2, self.sent
        first, second = self.sent
        assert first["tool_choice"] == "required" and first["tools"]
        jsonschema.validate(args, self.schema_of("get_weather"))
        assert weather(args["city"]) in json.dumps(second)


# -- the OpenAI Agents SDK ---------------------------------------------------------------------------


async def agents_sdk_run(url: str, api: str, streamed: bool) -> None:
    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    recorder = Recorder()
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, http_client=recorder.client())
    calls: list[str] = []

    # offered until called once: the small model would call it again on every turn
    @function_tool(is_enabled=lambda ctx, agent: not calls)
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return weather(city)

    kind = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
    settings = ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=64)
    agent = Agent(name="weather", instructions=INSTRUCTIONS, tools=[get_weather], output_type=Forecast,
                  model=kind(model="llm", openai_client=client), model_settings=settings)
    seen: list[str] = []
    if streamed:
        run = Runner.run_streamed(agent, QUESTION, max_turns=3)
        async for event in run.stream_events():
            seen.append(event.name if event.type == "run_item_stream_event" else event.type)
        result: Any = run
        assert "raw_response_event" in seen
        assert [e for e in seen if e in ("tool_called", "tool_output", "message_output_created")] == [
            "tool_called", "tool_output", "message_output_created"], seen
    else:
        result = await Runner.run(agent, QUESTION, max_turns=3)

    assert len(calls) == 1, calls
    items = result.new_items
    assert [type(i) for i in items] == [ToolCallItem, ToolCallOutputItem, MessageOutputItem], items
    call = items[0].raw_item
    assert call.name == "get_weather"
    args = json.loads(call.arguments)
    assert args == {"city": calls[0]}
    assert items[1].output == weather(calls[0])
    assert isinstance(result.final_output, Forecast) and result.final_output.city
    recorder.check_round_trip(args)
    await client.close()


def test_openai_agents_sdk_tool_round_trip(gateway: GatewayProcess) -> None:
    """openai-agents: an Agent with one function tool and an output type, on the chat-completions
    and the Responses model, run whole and streamed (the four at once): the tool is called once
    with valid arguments, its output goes back, the final answer is a validated Forecast; a
    streamed run's events name the call, its output and the answer in that order."""

    async def all_four() -> None:
        await asyncio.gather(*(agents_sdk_run(gateway.url, api, streamed)
                               for api in ("chat", "responses") for streamed in (False, True)))

    asyncio.run(all_four())


# -- pydantic-ai -------------------------------------------------------------------------------------


class FirstStepCallsTheTool(AbstractCapability[None]):
    """tool_choice per step, as pydantic-ai lets a capability vary it: required first, none after."""

    def get_model_settings(self) -> Any:
        return lambda ctx: {"tool_choice": "required" if ctx.run_step <= 1 else "none"}


async def pydantic_ai_run(url: str, streamed: bool) -> None:
    recorder = Recorder()
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, http_client=recorder.client())
    model = OpenAIChatModel("llm", provider=OpenAIProvider(openai_client=client))
    agent = PydanticAgent(model, instructions=INSTRUCTIONS, output_type=NativeOutput(Forecast),
                          model_settings={"temperature": 0, "max_tokens": 64, "parallel_tool_calls": False},
                          capabilities=[FirstStepCallsTheTool()])
    calls: list[str] = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return weather(city)

    if streamed:
        async with agent.run_stream(QUESTION) as run:
            output = await run.get_output()
            messages = run.all_messages()
    else:
        result = await agent.run(QUESTION)
        output, messages = result.output, result.all_messages()

    assert len(calls) == 1, calls
    parts = [p for m in messages for p in m.parts]
    call = next(p for p in parts if isinstance(p, ToolCallPart))
    returned = next(p for p in parts if isinstance(p, ToolReturnPart))
    assert call.tool_name == returned.tool_name == "get_weather"
    assert call.tool_call_id == returned.tool_call_id and returned.content == weather(calls[0])
    assert call.args_as_dict() == {"city": calls[0]}
    assert isinstance(output, Forecast) and output.city
    recorder.check_round_trip(call.args_as_dict())
    assert recorder.sent[1]["tool_choice"] == "none"
    await client.close()


def test_pydantic_ai_tool_round_trip(gateway: GatewayProcess) -> None:
    """pydantic-ai: an Agent with one tool and a native (response_format) output type through its
    OpenAI provider, run and run_stream at once: one call with valid arguments, its return in the
    history, a validated Forecast as the output."""

    async def both() -> None:
        await asyncio.gather(pydantic_ai_run(gateway.url, False), pydantic_ai_run(gateway.url, True))

    asyncio.run(both())


# -- LangGraph ---------------------------------------------------------------------------------------


async def langgraph_run(url: str, streamed: bool) -> None:
    calls: list[str] = []

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return weather(city)

    recorder = Recorder()
    llm = ChatOpenAI(model="llm", base_url=f"{url}/v1", api_key="unused", temperature=0, max_tokens=48,
                     max_retries=0, http_async_client=recorder.client())
    calling = llm.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False)
    answering = llm.bind_tools([get_weather], tool_choice="none")

    def pick(state: Any, runtime: Any) -> Any:  # create_react_agent's dynamic model
        return answering if isinstance(state["messages"][-1], ToolMessage) else calling

    agent = create_react_agent(pick, [get_weather])
    question = {"messages": [HumanMessage(QUESTION)]}
    if streamed:
        states = [s async for s in agent.astream(question, stream_mode="values")]
        state: Any = states[-1]
    else:
        state = await agent.ainvoke(question)

    messages = state["messages"]
    assert [type(m) for m in messages] == [HumanMessage, AIMessage, ToolMessage, AIMessage], messages
    asked, result, answer = messages[1:]
    assert len(asked.tool_calls) == 1 and not asked.invalid_tool_calls
    call = asked.tool_calls[0]
    assert call["name"] == "get_weather" and calls == [call["args"]["city"]]
    assert result.tool_call_id == call["id"] and result.content == weather(calls[0])
    assert isinstance(answer.content, str) and answer.content.strip() and not answer.tool_calls
    recorder.check_round_trip(call["args"])
    assert recorder.sent[1]["tool_choice"] == "none"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # create_react_agent moved to langchain.agents
def test_langgraph_react_agent_tool_round_trip(gateway: GatewayProcess) -> None:
    """LangGraph's prebuilt ReAct agent over ChatOpenAI, invoked and streamed at once: the tool node
    runs the model's one call (valid arguments), the ToolMessage answers its id, and the agent
    ends on the model's words."""

    async def both() -> None:
        await asyncio.gather(langgraph_run(gateway.url, False), langgraph_run(gateway.url, True))

    asyncio.run(both())
