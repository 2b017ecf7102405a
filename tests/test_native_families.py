"""Each tool syntax family on the real engine: the embedded model renders chats with a family's
public template (tests/fixtures/templates), and a required call, written in that family's own
markup under its grammar, is read back valid against its tool's schema, whichever tool the
sampled answer picks. 100 required calls in each of four families are the soak run (`-m soak`).

DeepSeek R1's and gpt-oss's templates think first (R1's opens the thought in the prompt; gpt-oss's
analysis message may come before a call): sampled, the small model may think to max_tokens, so
their calls are held token by token against the grammar in tests/test_tool_grammar.py here, and
tests/test_thought_budget.py ends the thought with a budget on the real engine: the required call
follows, for R1 and for gpt-oss (and tests/test_native_dialect.py reads gpt-oss's call in every
API)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from backends.base import Done, Token
from backends.contract import tools
from backends.contract.schema import GenerateRequest
from backends.llamacpp import LlamaCppBackend
from backends.llamacpp_settings import LlamaCppSettings

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
FAMILIES = [("Qwen-Qwen2.5-7B-Instruct", "hermes"), ("Qwen-Qwen3-0.6B", "hermes"),
            ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "hermes"),
            ("meta-llama-Llama-3.1-8B-Instruct", "llama3"), ("meta-llama-Llama-3.2-3B-Instruct", "llama3"),
            ("mistralai-Mistral-Nemo-Instruct-2407", "mistral"),
            ("Mistral-Small-3.2-24B-Instruct-2506", "mistral-args"),
            ("unsloth-mistral-Devstral-Small-2507", "mistral-args")]
TOOLS = [
    {"name": "get_weather", "description": "The current weather in a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city"], "additionalProperties": False}},
    {"name": "add", "description": "Add two integers.",
     "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"], "additionalProperties": False}},
]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
QUESTIONS = ["What is the weather in Paris?", "What is 2 plus 3?", "Weather in Tokyo, in fahrenheit?",
             "Add 40 and 2."]
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Dakar", "Hanoi", "Porto"]
# the soak's 100 distinct greedy asks, as the generic format's soak (tests/test_gateway_tools.py)
ASKS = [ask.format(city=c, n=i) for i, c in enumerate(CITIES) for ask in (
    "What is the weather in {city}?", "Weather in {city}, in fahrenheit?", "Is it raining in {city}?",
    "How warm is {city} today?", "Add {n} and 7.", "What is {n} plus {n}?", "Sum 3 and {n}.",
    "Tell me the weather for {city} in celsius.", "What is 100 plus {n}?", "Forecast for {city}?")]


def engine(template: str, slots: int) -> LlamaCppBackend:
    # a thread a core it may use (the engine's default): two threads on the one core a parallel
    # run gives each test spin at each other's barriers, about doubling the CPU
    return LlamaCppBackend(LlamaCppSettings(slots=slots, chat_template_file=TEMPLATES / f"{template}.jinja"))


def required(i: int, soak: bool = False) -> GenerateRequest:
    """The i-th ask: sampled (4 asks, seeds apart), or the soak's greedy distinct ones."""
    sampled = {"temperature": 0.8, "seed": i}
    ask, sampling = (ASKS[i], {"temperature": 0.0}) if soak else (QUESTIONS[i % 4], sampled)
    return GenerateRequest.model_validate({
        "messages": [{"role": "user", "content": ask}], "tools": TOOLS, "tool_choice": "required",
        "max_tokens": 96, **sampling})


def answers(b: LlamaCppBackend, n: int, soak: bool = False) -> Iterator[tuple[str, str, str]]:
    """(job id, text, finish reason) of n required calls, `slots` at a time."""
    waiting, texts = list(range(n)), {}
    while waiting or texts:
        while waiting and b.free_slots() > 0:
            i = waiting.pop(0)
            request = required(i, soak)
            assert b.speaks(request) and tools.answers_in_json(request)
            b.admit(f"j{i}", request)
            texts[f"j{i}"] = []
        for ev in b.step(0.01):
            if isinstance(ev, Token):
                texts[ev.job_id].append(ev.text)
            elif isinstance(ev, Done):
                yield ev.job_id, "".join(texts.pop(ev.job_id)), ev.finish_reason
            else:
                raise AssertionError(ev)


def check_calls(job_id: str, text: str, finish: str) -> None:
    """At least one call, each valid; an answer max_tokens cut keeps its complete calls (a
    sampled answer may go on to a second call); one that ended shows no markup."""
    answer = tools.read_answer(text, job_id)
    assert answer.tool_calls and finish in ("stop", "length"), (text, finish)
    for call in answer.tool_calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    if finish == "stop":
        assert "<tool_call>" not in text and "[TOOL_CALLS]" not in text, text  # read, not passed on


@pytest.mark.model
@pytest.mark.parametrize(("template", "syntax"), FAMILIES)
def test_a_required_call_in_each_family(template: str, syntax: str) -> None:
    b = engine(template, slots=4)
    try:
        assert b.dialect.syntax is not None and b.dialect.syntax.name == syntax
        for job_id, text, finish in answers(b, 4):
            check_calls(job_id, text, finish)
    finally:
        b.close()


@pytest.mark.soak
@pytest.mark.parametrize("template", ["Qwen-Qwen2.5-7B-Instruct", "meta-llama-Llama-3.1-8B-Instruct",
                                      "mistralai-Mistral-Nemo-Instruct-2407",
                                      "unsloth-mistral-Devstral-Small-2507"])
def test_a_hundred_required_calls_all_valid(template: str) -> None:
    b = engine(template, slots=8)
    try:
        done = [check_calls(*a) for a in answers(b, len(ASKS), soak=True)]
        assert len(done) == 100
    finally:
        b.close()
