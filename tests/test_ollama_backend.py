"""OllamaBackend against the Ollama-API test server (tests/ollama_api_server.py) on the real model:
generate and chat streaming, options, 404 unknown model, 503 busy, an error line mid-stream, cancel."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from backends.base import BackendUnavailable, Done, Event, Failed, JobRejected, Token
from backends.contract.schema import GenerateRequest, Message, SamplingDefaults
from backends.contract.tools import read_answer
from backends.http_settings import OllamaSettings
from backends.ollama import OllamaBackend, Thoughts, think_field
from tests.ollama_api_server import BUSY_ERROR, RUNNER_ERROR, OllamaApiServer, serve
from tests.real_servers import free_port, model_path

pytestmark = pytest.mark.timeout(120)
MODEL = "gemma3:270m"


@pytest.fixture(scope="module")
def server() -> Iterator[OllamaApiServer]:
    s = serve(str(model_path()), names=(MODEL, "gemma3:spare"))
    yield s
    s.shutdown()


def make(server: OllamaApiServer, model: str = MODEL, **kw: object) -> OllamaBackend:
    return OllamaBackend(
        OllamaSettings.model_validate({"endpoint": server.url, "model": model, **kw})
    )


@pytest.fixture
def backend(server: OllamaApiServer) -> Iterator[OllamaBackend]:
    b = make(server)
    yield b
    b.close()


def greedy(**kw: object) -> GenerateRequest:
    return GenerateRequest.model_validate({"temperature": 0.0, "seed": 3, **kw})


def run_one(backend: OllamaBackend, job_id: str, request: GenerateRequest) -> list[Event]:
    backend.admit(job_id, request)
    events: list[Event] = []
    deadline = time.monotonic() + 60
    while not any(isinstance(e, Done | Failed) for e in events):
        assert time.monotonic() < deadline, events
        events += backend.step(0.5)
    return events


def wait_until_idle(server: OllamaApiServer, pace: float) -> None:
    """Until the server stops generating: within 3 s or 30 of its tokens (`pace`: seconds a token,
    measured in the same run), far fewer than the hung-up request asked for, on any CPU and load."""
    deadline = time.monotonic() + max(3.0, 30 * pace)
    while server.active:
        assert time.monotonic() < deadline, "the test server is still generating"
        time.sleep(0.02)


def text(events: list[Event]) -> str:
    return "".join(e.text for e in events if isinstance(e, Token))


def test_generate_streams_tokens_and_reports_usage(server: OllamaApiServer, backend: OllamaBackend) -> None:
    assert backend.slots == 1 and backend.free_slots() == 1  # Ollama's default OLLAMA_NUM_PARALLEL
    request = greedy(prompt="The capital of France is", max_tokens=8)
    d = SamplingDefaults.model_validate({})
    options = {"num_predict": 8, "temperature": 0.0, "seed": 3, "top_k": d.top_k, "top_p": d.top_p}
    options |= {"min_p": d.min_p, "repeat_penalty": d.repeat_penalty}
    ask = {"model": MODEL, "prompt": request.prompt, "raw": True, "stream": False, "options": options}
    # the model's prompt cache: a repeated prompt re-evaluates only its last token, which can round
    # differently from a whole-prompt prefill and flip this answer's near-ties (0.13 nats at " of"):
    # both compared answers are repeats
    httpx.post(f"{server.url}/api/generate", json=ask, timeout=120)
    events = run_one(backend, "g", request)
    tokens = [e for e in events if isinstance(e, Token)]
    done = events[-1]
    assert isinstance(done, Done) and done.finish_reason == "length"
    assert len(tokens) > 3 and done.completion_tokens == 8
    assert done.prompt_tokens == 6  # <bos> + 5 prompt tokens, counted by the server
    assert done.extra["done_reason"] == "length"
    timings = done.extra["timings_ns"]
    assert isinstance(timings, dict) and timings["eval_duration"] > 0
    # the same request without streaming gives the same text (raw prompt, greedy, same options)
    direct = httpx.post(f"{server.url}/api/generate", json=ask, timeout=120).json()
    assert text(events) == direct["response"] and direct["eval_count"] == 8


def test_chat_streams_the_assistant_message(backend: OllamaBackend) -> None:
    request = greedy(
        messages=[Message(role="system", content="Answer briefly."), Message(role="user", content="Hi!")],
        max_tokens=6,
    )
    events = run_one(backend, "c", request)
    done = events[-1]
    assert isinstance(done, Done) and done.completion_tokens <= 6
    assert done.prompt_tokens > 10  # the templated turns, not just "Hi!"
    assert text(events) and all(isinstance(e, Token) for e in events[:-1])


def test_stop_strings_and_done_reason_stop(backend: OllamaBackend) -> None:
    events = run_one(backend, "s", greedy(prompt="Counting: 1, 2, 3, 4, 5,", max_tokens=40, stop=[" 8"]))
    done = events[-1]
    assert isinstance(done, Done) and done.finish_reason == "stop" and done.extra["done_reason"] == "stop"
    assert text(events) == " 6, 7,"


def test_unknown_model_at_start_is_a_clear_backend_unavailable(server: OllamaApiServer) -> None:
    with pytest.raises(
        BackendUnavailable, match=r"has no model 'llama9:70b' \(run `ollama pull llama9:70b`\)"
    ):
        make(server, model="llama9:70b")


def test_model_removed_later_fails_jobs_with_404_retryable(server: OllamaApiServer) -> None:
    spare = make(server, model="gemma3:spare")
    try:
        deleted = httpx.request("DELETE", f"{server.url}/api/delete", json={"model": "gemma3:spare"})
        assert deleted.status_code == 200
        end = run_one(spare, "m", greedy(prompt="hello", max_tokens=2))[-1]
        assert isinstance(end, Failed) and end.retryable
        assert "has no model 'gemma3:spare' (404)" in end.error and "not found" in end.error
    finally:
        spare.close()


def test_busy_server_answers_503_and_the_job_fails_retryable(
    server: OllamaApiServer, backend: OllamaBackend
) -> None:
    """Another client holds Ollama's only slot (OLLAMA_NUM_PARALLEL=1, no queue)."""
    streaming = threading.Event()
    release = threading.Event()

    lines: list[float] = []  # when each streamed line came

    def other_client() -> None:
        body = {"model": MODEL, "prompt": "A long story:", "raw": True, "options": {"num_predict": 400}}
        with httpx.stream("POST", f"{server.url}/api/generate", json=body, timeout=60) as r:
            for _ in r.iter_lines():
                lines.append(time.monotonic())
                streaming.set()
                if release.is_set():
                    break

    holder = threading.Thread(target=other_client)
    holder.start()
    try:
        assert streaming.wait(30)
        end = run_one(backend, "b", greedy(prompt="hello", max_tokens=2))[-1]
    finally:
        release.set()
        holder.join()
    assert isinstance(end, Failed) and end.retryable
    assert "is busy (503)" in end.error and BUSY_ERROR in end.error
    pace = (lines[-1] - lines[0]) / (len(lines) - 1) if len(lines) > 1 else 1.0
    wait_until_idle(server, pace)  # the other client hung up: its generation stops
    assert isinstance(run_one(backend, "after", greedy(prompt="hello", max_tokens=2))[-1], Done)


def test_error_line_mid_stream_fails_the_job_retryable(
    server: OllamaApiServer, backend: OllamaBackend
) -> None:
    server.error_after = 2
    try:
        events = run_one(backend, "e", greedy(prompt="Once upon a time", max_tokens=20))
    finally:
        server.error_after = None
    assert [type(e) for e in events] == [Token, Token, Failed]
    end = events[-1]
    assert isinstance(end, Failed) and end.retryable
    assert end.error == f"ollama at {server.url} failed mid-stream: {RUNNER_ERROR}"


def test_cancel_closes_the_stream_and_the_server_is_free_again(
    server: OllamaApiServer, backend: OllamaBackend
) -> None:
    started = time.monotonic()
    backend.admit("long", greedy(prompt="A very long story:", max_tokens=1000))
    events: list[Event] = []
    while sum(isinstance(e, Token) for e in events) < 3:
        events += backend.step(1.0)
    pace = (time.monotonic() - started) / 3  # the prompt's time in it too: more than a token takes
    backend.cancel("long")
    ended = backend.step(1.0)
    assert next(e for e in ended if isinstance(e, Done)).finish_reason == "cancelled"
    assert backend.free_slots() == 1
    wait_until_idle(server, pace)  # 1000 tokens would take far longer: the server stopped generating
    assert isinstance(run_one(backend, "next", greedy(prompt="hello", max_tokens=2))[-1], Done)


def test_unreachable_ollama_is_backend_unavailable() -> None:
    with pytest.raises(BackendUnavailable, match=r"ollama at .* not ready after 0.5s"):
        OllamaBackend(
            OllamaSettings(endpoint=f"http://127.0.0.1:{free_port()}", connect_timeout=0.5)
        )


def test_what_ollama_lacks_is_refused_by_name_and_its_show_becomes_the_card(backend: OllamaBackend) -> None:
    for fields in ({"min_tokens": 4}, {"ignore_eos": True}):
        with pytest.raises(JobRejected, match=f"{next(iter(fields))}: not supported by the ollama backend"):
            backend.admit("x", greedy(prompt="hi", max_tokens=8, **fields))
    assert backend.free_slots() == backend.slots
    card = backend.model_card()
    assert card["details"] == {"format": "gguf", "family": "gemma3"} and card["template"] == "{{ .Prompt }}"


def test_think_goes_only_to_a_thinking_model(backend: OllamaBackend) -> None:
    """The test server's model has no "thinking" capability: a chat whose template kwargs ask to
    think (as the gateway writes Anthropic's `thinking` or a reasoning effort) gets no `think`,
    which Ollama would refuse with a 400, and answers."""
    events = run_one(backend, "t", greedy(messages=[Message(role="user", content="Say hi.")], max_tokens=4,
                                          chat_template_kwargs={"enable_thinking": True,
                                                                "reasoning_effort": "low"}))
    assert isinstance(events[-1], Done) and text(events)


def test_thoughts_become_the_answer_json_inline_text_or_nothing() -> None:
    apart = Thoughts("j", apart=True)
    streamed = apart.feed("Sea ", "") + apart.feed("waves.", "") + apart.feed("", "Hi.") + apart.close()
    answer = read_answer(streamed, "j")
    assert (answer.reasoning, answer.content) == ("Sea waves.", "Hi.")
    inline = Thoughts("j", apart=False)
    assert inline.feed("Sea", "") + inline.feed("", "Hi.") + inline.close() == "<think>Sea</think>Hi."
    held_to_json = Thoughts("j", apart=False, inline=False)  # a format: the answer starts with its JSON
    json_text = held_to_json.feed("Sea", "") + held_to_json.feed("", '{"a": 1}') + held_to_json.close()
    assert json_text == '{"a": 1}'
    request = greedy(messages=[Message(role="user", content="Hi")])
    assert think_field(request, apart=True) is True and think_field(request, apart=False) is None
    effort = request.model_copy(update={"chat_template_kwargs": {"reasoning_effort": "high"}})
    assert think_field(effort, False, levels=True) == "high" and think_field(effort, False) is True
    assert think_field(request.model_copy(update={"reasoning_budget": 0}), apart=True) is False
