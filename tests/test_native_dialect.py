"""A model's own dialect end to end, on the real engine through `fleet serve`: the embedded model
renders chats with a public chat template (a fixture; `backend.chat_template_file`), its tools in
that template's own words, its calls written in the template's native syntax under a grammar
(`<tool_call>` for Qwen 2.5's Hermes format), read back into each API's shape, streamed and whole;
and a thinking template's thoughts returned apart in each API.

The small model cannot be trusted to choose a call on its own, so calls are forced where an API can
say so (`tool_choice: required`: the grammar starts at once). Ollama's API has no tool_choice:
llama-fleet's extension field forces it there."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic as anthropic_sdk
import httpx
import jsonschema
import ollama
import openai
import pytest

from backends.contract.keys import tenant_open_key
from backends.contract.queue.invariants import queue_violations
from backends.model import default_model_path
from tests.gateway_harness import wait_until_healthy
from tests.harness import WorkerProcess, start_worker, wait_for
from tests.real_fleet import RealFleet, fleet_processes
from tests.reliability_checks import held, stream_events, streaming
from tests.test_gateway_tools import schema_of

pytestmark = [pytest.mark.timeout(600), pytest.mark.model]
TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
THINKING = Path(__file__).parent / "fixtures" / "thinking-opened.jinja"


def template(pattern: str) -> Path:
    found = sorted(TEMPLATES.glob(pattern))
    assert found, f"no template fixture matches {pattern}"
    return found[0]


WEATHER = {"type": "function", "function": {"name": "get_weather",
                                            "description": "The current weather in a city.",
                                            "parameters": schema_of("get_weather")}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SEA = [{"role": "user", "content": "Write one sentence about the sea."}]
# the template's end of turn is text to the embedded model (not its end-of-generation token)
STOPS = ["<|im_end|>"]


def check_call(name: str, arguments: str | dict[str, Any]) -> dict[str, Any]:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert name == "get_weather"
    jsonschema.validate(args, schema_of("get_weather"))
    return args


# the other families (Hermes and gpt-oss below): a template, its call markup that must never
# reach an answer's words, and whether its thought comes first (R1's prompt opens one: its budget
# ends it, Ollama's think false closes it at once)
FAMILIES = [("meta-llama-Llama-3.1*", '"name"', False), ("*Mistral-Nemo*", "[TOOL_CALLS]", False),
            ("*Devstral*", "[TOOL_CALLS]", False), ("*DeepSeek-R1*", "tool\u2581calls", True)]
FAMILY_IDS = ["llama3", "mistral", "mistral-args", "deepseek-r1"]
FAMILY_CASES = list(zip(FAMILY_IDS, FAMILIES, strict=True))
# the module's tests share one gateway: a template's test asks for its model by name. Templates
# that do not think are catalogue models (the embedded weights each time) of one worker; a
# thinking one has a worker of its own in its own pool, since the gateway learns that a pool's
# template thinks from its workers' own template, not a catalogue model's
TEMPLATE_OF = {"qwen2.5": template("*Qwen2.5*"),
               **{name: template(p) for name, (p, _, t) in FAMILY_CASES if not t}}
THINKING_OF = {"gpt-oss": template("*gpt-oss*"), "thinking": THINKING,
               **{name: template(p) for name, (p, _, t) in FAMILY_CASES if t}}


class Dialects:
    """The module's fleet, and a worker for each thinking template, started when a test first
    asks for it (`url_for`) and stopped with the fleet."""

    def __init__(self, fleet: RealFleet, log_dir: Path) -> None:
        self.fleet, self.log_dir = fleet, log_dir
        self.thinking: dict[str, WorkerProcess] = {}

    def url_for(self, model: str) -> str:
        if model in THINKING_OF and model not in self.thinking:
            self.thinking[model] = start_worker(
                self.fleet.redis_url, f"dialects-{model}", self.log_dir, pool=model,
                backend__slots=2 if model == "thinking" else 4,
                backend__chat_template_file=str(THINKING_OF[model]))
            wait_for(lambda: self.pools().get(model), 30, f"the gateway to see {model}'s worker")
        return self.fleet.url

    def pools(self) -> dict[str, int]:
        """Each pool's live workers, as the gateway sees them."""
        pools: dict[str, int] = httpx.get(f"{self.fleet.url}/health", timeout=10).json()["pools"]
        return pools

    def check_serving(self) -> None:
        self.fleet.check_serving()
        for worker in self.thinking.values():
            assert worker.alive(), f"a test stopped a shared worker:\n{worker.output()[-3000:]}"


@pytest.fixture(scope="module")
def dialects_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dialects]:
    weights, dir = str(default_model_path()), tmp_path_factory.mktemp("dialects")
    models = {name: {"path": weights, "chat_template_file": str(path)} for name, path in TEMPLATE_OF.items()}
    gateway = {"models": models, "gateway__models": {name: name for name in THINKING_OF}}
    with fleet_processes(dir, "dialects", {"models": models, "backend__slots": 4}, gateway) as fleet:
        dialects = Dialects(fleet, dir / "logs")
        try:
            yield dialects
        finally:
            for worker in dialects.thinking.values():
                worker.kill()


@pytest.fixture
def dialects(dialects_fleet: Dialects) -> Iterator[Dialects]:
    dialects_fleet.check_serving()
    yield dialects_fleet
    dialects_fleet.check_serving()


def test_a_native_call_in_every_api(dialects: Dialects) -> None:
    calls_in_every_api(dialects.url_for("qwen2.5"), "qwen2.5", "<tool_call>", chat={"stop": STOPS})


def test_a_gpt_oss_call_in_every_api_after_its_budgeted_analysis(dialects: Dialects) -> None:
    """gpt-oss thinks in an analysis message first, which the small model never ends: each API's
    way of holding a thought to a budget (or turning it off) ends it, and the call follows."""
    budget = {"reasoning_budget": 8}
    calls_in_every_api(dialects.url_for("gpt-oss"), "gpt-oss", "<|channel|>", thinks=True, max_tokens=160,
                       chat=budget, responses=budget,
                       anthropic={"thinking": {"type": "enabled", "budget_tokens": 8}},
                       ollama={"think": False})


@pytest.mark.parametrize(("model", "markup", "thinks"),
                         [(name, markup, thinks) for name, (_, markup, thinks) in FAMILY_CASES],
                         ids=FAMILY_IDS)
def test_a_native_call_of_each_family_in_every_api(dialects: Dialects, model: str, markup: str,
                                                    thinks: bool) -> None:
    # one call each (the small model writes a second where the syntax allows several; Ollama's
    # API cannot say so)
    one = {"parallel_tool_calls": False, **({"reasoning_budget": 12} if thinks else {})}
    claude = {"tool_choice": {"type": "any", "disable_parallel_tool_use": True},
              **({"thinking": {"type": "enabled", "budget_tokens": 12}} if thinks else {})}
    calls_in_every_api(dialects.url_for(model), model, markup, thinks=thinks, max_tokens=160, chat=one,
                       responses=one, anthropic=claude, ollama={"think": False} if thinks else None,
                       ollama_one=False)


def test_a_tenants_gpt_oss_call_survives_its_workers_death(redis, workers, gateways) -> None:
    """Where features meet: a tenant's forced gpt-oss call, its analysis held to a budget, on a
    worker killed mid-answer: the other worker runs it again (a native dialect's job restarts),
    the client gets one valid call, the tenant's places are given back, the queue's invariants
    hold. Each worker pinned to a core of its own."""
    tenants = {"gamma": {"api_keys": ["key-gamma"], "max_concurrent": 2, "max_queued": 4}}
    cores = sorted(os.sched_getaffinity(0))
    started = [workers.start(name, cpus=str(cores[i % len(cores)]), backend__slots=2,
                             backend__chat_template_file=str(template("*gpt-oss*")), gateway__tenants=tenants)
               for i, name in enumerate(("w1", "w2"))]
    gw = gateways.start(gateway__tenants=tenants)
    wait_until_healthy(gw)
    answer: dict[str, httpx.Response] = {}

    body = {"model": "llm", "messages": ASK, "tools": [WEATHER], "max_tokens": 160,
            "tool_choice": "required", "temperature": 0, "reasoning_budget": 8}

    def ask() -> None:
        answer["r"] = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=180,
                                 headers={"Authorization": "Bearer key-gamma"})

    asking = threading.Thread(target=ask)
    asking.start()
    victim = wait_for(lambda: next((w for w in started if streaming(redis, w.name)), None), 120,
                      "a worker to stream the call")
    (job_id,) = held(redis, victim.name)
    os.kill(victim.process.pid, signal.SIGKILL)
    victim.process.wait(10)
    asking.join(180)
    reply = answer["r"]
    assert reply.status_code == 200, reply.text
    (call,) = reply.json()["choices"][0]["message"]["tool_calls"]
    check_call(call["function"]["name"], call["function"]["arguments"])
    finals = [ev for ev in stream_events(redis, job_id) if ev.final]
    assert [(ev.kind, ev.attempt) for ev in finals] == [("done", 2)]  # it ran again, and ended once
    wait_for(lambda: not redis.zcard(tenant_open_key("gamma")), 30, "the tenant's places to be given back")
    assert not queue_violations(redis), queue_violations(redis)


def calls_in_every_api(url: str, model: str, markup: str, *, thinks: bool = False, max_tokens: int = 80,
                       chat: dict[str, Any] | None = None,
                       responses: dict[str, Any] | None = None,
                       anthropic: dict[str, Any] | None = None, ollama: dict[str, Any] | None = None,
                       ollama_one: bool = True) -> None:
    """A required get_weather call, whole and streamed, in the OpenAI chat, Responses, Anthropic
    and Ollama shapes from `model`, the same call each time and no `markup` of the native syntax
    as words; each API's body takes its extra fields. `thinks`: a thought comes apart before the call
    (Ollama's extra fields turn it off). `ollama_one`: Ollama's answer holds one call (else its
    first is the call, whole and streamed alike)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    forced = {"model": model, "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
              "temperature": 0, "max_tokens": max_tokens}

    whole = client.chat.completions.create(**forced, extra_body=chat)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    call = choice.message.tool_calls[0]
    args = check_call(call.function.name, call.function.arguments)
    assert bool(getattr(choice.message, "reasoning_content", None)) == thinks

    # the rest at once, as clients of one server are (the worker batches them: ~a quarter less
    # CPU than one after another); each raises its own failure
    def streamed_chat() -> None:
        names, arguments, contents = [], "", ""
        for chunk in client.chat.completions.create(**forced, stream=True, extra_body=chat):
            delta = chunk.choices[0].delta if chunk.choices else None
            for c in (delta.tool_calls or []) if delta else []:
                if c.function and c.function.name:
                    names.append(c.function.name)
                arguments += (c.function.arguments or "") if c.function else ""
            contents += (delta.content or "") if delta else ""
        assert names == ["get_weather"] and json.loads(arguments) == args
        assert markup not in contents

    def responses_api() -> None:
        # the Responses API: a function_call item
        asked = {"model": model, "input": "What is the weather in Paris?", "tool_choice": "required",
                 "tools": [{"type": "function", **WEATHER["function"]}], "temperature": 0,
                 "max_output_tokens": max_tokens, **(responses or {})}
        raw = httpx.post(f"{url}/v1/responses", json=asked, timeout=120).json()
        items = [i for i in raw["output"] if i["type"] == "function_call"]
        assert items and check_call(items[0]["name"], items[0]["arguments"]) == args, raw
        with httpx.stream("POST", f"{url}/v1/responses", timeout=120, json={**asked, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        finished = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert [i["type"] for i in finished] == ["reasoning"] * thinks + ["function_call"]
        assert events[-1]["type"] == "response.completed"
        assert check_call(finished[-1]["name"], finished[-1]["arguments"]) == args
        assert not any(e["type"] == "response.output_text.delta" for e in events)  # no markup as words

    def anthropic_api() -> None:
        # Anthropic: a tool_use block (tool_choice any)
        claude = anthropic_sdk.Anthropic(base_url=url, api_key="none", max_retries=0)
        asked_claude = {"model": model, "max_tokens": max_tokens, "messages": ASK,
                        "tool_choice": {"type": "any"},
                        "tools": [{"name": "get_weather", "description": "The current weather in a city.",
                                   "input_schema": schema_of("get_weather")}],
                        "extra_body": {"temperature": 0}, **(anthropic or {})}
        message = claude.messages.create(**asked_claude)
        assert [b.type for b in message.content] == ["thinking"] * thinks + ["tool_use"]
        uses = [b for b in message.content if b.type == "tool_use"]
        assert message.stop_reason == "tool_use" and uses and check_call(uses[0].name, uses[0].input) == args
        with claude.messages.stream(**asked_claude) as stream:
            streamed_message = stream.get_final_message()
        assert [b.type for b in streamed_message.content] == ["thinking"] * thinks + ["tool_use"]
        uses = [b for b in streamed_message.content if b.type == "tool_use"]
        assert check_call(uses[0].name, uses[0].input) == args

    def ollama_api() -> None:
        # Ollama's API cannot force a call: llama-fleet's tool_choice extension does (raw HTTP: the
        # ollama client sends only Ollama's fields), whole and streamed
        ollama_body = {"model": model, "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
                       "stream": False, "options": {"temperature": 0, "num_predict": max_tokens},
                       **(ollama or {})}
        message = httpx.post(f"{url}/api/chat", json=ollama_body, timeout=120).json()["message"]
        calls = message["tool_calls"]
        assert (len(calls) == 1 if ollama_one else calls) and not message.get("thinking"), message
        assert check_call(calls[0]["function"]["name"], calls[0]["function"]["arguments"]) == args
        lines = httpx.post(f"{url}/api/chat", json={**ollama_body, "stream": True},
                           timeout=120).text.splitlines()
        streamed = [c for ln in lines for c in json.loads(ln)["message"].get("tool_calls") or []]
        assert [c["function"] for c in streamed] == [c["function"] for c in calls]
        assert all(markup not in json.loads(ln)["message"]["content"] for ln in lines)

    with ThreadPoolExecutor(4) as pool:
        checks = (streamed_chat, responses_api, anthropic_api, ollama_api)
        for running in [pool.submit(check) for check in checks]:
            running.result()


def test_thoughts_apart_in_every_api(dialects: Dialects) -> None:
    """A template whose generation prompt opens a thought (as DeepSeek R1's does): everything the
    model writes before `</think>` is reasoning, returned apart; with reasoning_format none it
    stays in the text."""
    model = "thinking"
    url = dialects.url_for(model)
    # (a few tokens: this small model soon writes "<think>" again, an opener inside the thought)
    body = {"model": model, "messages": SEA, "temperature": 0, "max_tokens": 8}
    plain = httpx.post(f"{url}/v1/chat/completions", json={**body, "reasoning_format": "none"},
                       timeout=120).json()["choices"][0]["message"]
    apart = httpx.post(f"{url}/v1/chat/completions", json=body,
                       timeout=120).json()["choices"][0]["message"]
    assert plain["content"] and "reasoning_content" not in plain
    thought = plain["content"].strip()  # the whole answer: the model never closed the thought
    assert apart["reasoning_content"].strip() == thought and not apart["content"]

    streamed = ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    assert not c["delta"].get("content")
                    streamed += c["delta"].get("reasoning_content") or ""
    assert streamed.strip() == thought

    said = ollama.Client(host=url).chat(model=model, messages=SEA, think=True,
                                           options={"temperature": 0, "num_predict": 8})
    assert (said.message.thinking or "").strip() == thought and not said.message.content

    response = httpx.post(f"{url}/v1/responses", json={
        "model": model, "input": SEA[0]["content"], "temperature": 0, "max_output_tokens": 8},
        timeout=120).json()
    reasoning = [i for i in response["output"] if i["type"] == "reasoning"]
    assert reasoning and reasoning[0]["content"][0]["text"].strip() == thought

    claude = anthropic_sdk.Anthropic(base_url=url, api_key="none", max_retries=0)
    message = claude.messages.create(model=model, max_tokens=8, messages=SEA, extra_body={"temperature": 0},
                                     thinking={"type": "enabled", "budget_tokens": 1024})
    blocks = [b for b in message.content if b.type == "thinking"]
    assert blocks and blocks[0].thinking.strip() == thought
