"""A chat with tools in a model's own syntax drafts while its lazy grammar awaits its trigger, on the
real engine (the embedded model rendering Qwen 2.5's template: Hermes calls, `<tool_call>` starts
the grammar). Greedy text is the same with prompt-lookup drafts on as off: a plain answer (drafts
all the way), an answer that ends in a call (drafts up to the token at which the grammar fires,
their later rows dropped, then one token at a time), and a required call (never lazy: no draft).

With batch_invariant, as tests/test_speculation.py's "any prompt" claim: by default a drafted
call's rows may round apart from one-row steps, and the plain answer here meets a near-tie (a
0.04 logit gap at its 43rd token) that tips with the tools' longer prompt, drafts or no grammar.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.base import Done, Failed, Token
from backends.contract import tools
from backends.contract.schema import GenerateRequest
from backends.llamacpp import LlamaCppBackend
from backends.llamacpp.scheduler import DecodeCall
from backends.llamacpp.state import ActiveJob, Sampled
from backends.llamacpp_settings import LlamaCppSettings
from tests import invariant_kernels
from tests.invariant_kernels import verdict_elsewhere

pytestmark = [pytest.mark.timeout(invariant_kernels.SECONDS), pytest.mark.model]
TEMPLATE = Path(__file__).parent / "fixtures" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
TOOLS = [{"name": "get_weather", "description": "The current weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}]


def history(city: str) -> list[dict[str, Any]]:
    """Earlier turns that called the tool: the small model copies them, a turn and a call (and
    prompt lookup drafts from them, across the call's trigger)."""
    messages: list[dict[str, Any]] = []
    for earlier in ("Paris", "Lima"):
        call = {"id": f"call_{earlier}", "name": "get_weather", "arguments": f'{{"city": "{earlier}"}}'}
        messages += [{"role": "user", "content": f"What is the weather in {earlier}?"},
                     {"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "content": "sunny", "tool_call_id": call["id"]}]
    return [*messages, {"role": "user", "content": f"What is the weather in {city}?"}]


Engines = dict[int, LlamaCppBackend]  # by draft_max
STORY = [{"role": "user", "content": "Write a short story about a lighthouse."}]


@pytest.fixture(scope="module")
def _engines() -> Iterator[Engines | None]:
    """The engines, drafts off and on, made only in the tests' process of their own (batch_invariant
    needs the process's first model: tests/invariant_kernels.py)."""
    if not invariant_kernels.here():
        yield None
        return
    made = {draft_max: LlamaCppBackend(LlamaCppSettings(slots=1, chat_template_file=TEMPLATE,
                                                        draft_max=draft_max, batch_invariant=True),
                                       threads=2)
            for draft_max in (0, 6)}
    yield made
    for b in made.values():
        b.close()


@pytest.fixture
def engines(request: pytest.FixtureRequest, _engines: Engines | None) -> object:
    return invariant_kernels.engine_or_verdict(request, _engines)


def run(b: LlamaCppBackend, body: dict[str, Any]) -> tuple[str, str, list[int], list[tuple[int, int, bool]]]:
    """One job alone: its stream, finish reason, tokens, and per decoders' call its draft's
    length, the rows the executor sampled and whether its lazy grammar fired there."""
    request = GenerateRequest.model_validate({"temperature": 0.0, "tools": TOOLS, **body})
    assert b.speaks(request) and tools.answers_in_json(request)
    calls: list[tuple[int, int, bool]] = []
    scheduler, update = b.scheduler, b.scheduler.update

    def watched(call: DecodeCall, sampled: Sampled, seconds: float = 0.0) -> Any:
        for job in call.decoders:
            if job.seq_id in sampled.rows:
                calls.append((len(call.drafts.get(job.seq_id, ())), len(sampled.rows[job.seq_id]),
                              job.seq_id in sampled.triggered))
        return update(call, sampled, seconds)

    scheduler.update = watched  # type: ignore[method-assign]
    try:
        text, finish, job = one_job(b, request)
        return text, finish, list(job.output), calls
    finally:
        del scheduler.update


def one_job(b: LlamaCppBackend, request: GenerateRequest) -> tuple[str, str, ActiveJob]:
    """A job alone on the engine, to its end: its stream, its finish reason and its state (the
    tokens it generated)."""
    b.admit("j", request)
    job = b.scheduler.active["j"]
    text: list[str] = []
    while True:
        for ev in b.step(0.0):
            if isinstance(ev, Token):
                text.append(ev.text)
            elif isinstance(ev, Done):
                return "".join(text), ev.finish_reason, job
            elif isinstance(ev, Failed):
                raise AssertionError(ev)


@verdict_elsewhere
def test_a_plain_answer_drafts_and_reads_as_without_drafts(engines: Engines) -> None:
    body = {"messages": STORY, "max_tokens": 64, "ignore_eos": True}
    alone = run(engines[0], body)
    drafted = run(engines[6], body)
    assert drafted[:3] == alone[:3]
    answer = tools.read_answer(drafted[0], "j")
    assert not answer.tool_calls and answer.content
    assert sum(n for n, _, _ in drafted[3]) > 0  # it drafted
    assert not any(fired for _, _, fired in drafted[3])


@verdict_elsewhere
def test_an_answer_ending_in_a_call_drafts_up_to_its_trigger(engines: Engines) -> None:
    seen_cut = False
    for city in ("Oslo", "Rome"):
        body = {"messages": history(city), "max_tokens": 80}
        alone = run(engines[0], body)
        drafted = run(engines[6], body)
        assert drafted[:3] == alone[:3], city
        text, finish, _, calls = drafted
        answer = tools.read_answer(text, "j")
        # a call, complete (the model may go on to a second one, cut by max_tokens)
        assert answer.tool_calls and answer.tool_calls[0]["name"] == "get_weather", (text, finish)
        fired = [i for i, (_, _, f) in enumerate(calls) if f]
        assert len(fired) == 1  # the grammar fired once, at a token a call sampled
        assert all(n == 0 for n, _, _ in calls[fired[0] + 1:])  # no draft after it
        draft, rows, _ = calls[fired[0]]
        seen_cut = seen_cut or rows - 1 < draft  # the draft went on past the trigger: cut there
    assert seen_cut


@verdict_elsewhere
def test_a_required_call_never_drafts(engines: Engines) -> None:
    body = {"messages": history("Oslo"), "tool_choice": "required", "max_tokens": 60}
    alone = run(engines[0], body)
    drafted = run(engines[6], body)
    assert drafted[:3] == alone[:3]
    assert [c["name"] for c in tools.read_answer(drafted[0], "j").tool_calls] == ["get_weather"]
    assert all(n == 0 for n, _, _ in drafted[3])
