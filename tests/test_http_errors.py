"""How the HTTP backends map an engine's errors to job failures, driven through
`httpx.MockTransport` (no server): every status and transport error, before and during the
stream, lands as one Failed event with the engine's own words and the right `retryable`."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx
import pytest

from backends.base import BackendUnavailable, Done, Event, Failed
from backends.contract.schema import GenerateRequest
from backends.http_pool import HttpStreamBackend
from backends.http_settings import LlamaServerSettings, OllamaSettings
from backends.llama_server import LlamaServerBackend
from backends.ollama import OllamaBackend

pytestmark = pytest.mark.timeout(60)
Job = Callable[[httpx.Request], httpx.Response]
ENDPOINT = "http://engine.test:8080"


def llama_server(job: Job) -> LlamaServerBackend:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if request.url.path == "/props":
            return httpx.Response(200, json={"total_slots": 2})
        return job(request)

    settings = LlamaServerSettings(endpoint=ENDPOINT, connect_timeout=2)
    return LlamaServerBackend(settings, transport=httpx.MockTransport(handle))


def ollama(job: Job, show_status: int = 200) -> OllamaBackend:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/version":
            return httpx.Response(200, json={"version": "0.9.0"})
        if request.url.path == "/api/show":
            return httpx.Response(show_status, json={} if show_status == 200 else {"error": "not found"})
        return job(request)

    settings = OllamaSettings(endpoint=ENDPOINT, model="gemma3:270m", connect_timeout=2)
    return OllamaBackend(settings, transport=httpx.MockTransport(handle))


def sse(*chunks: object) -> httpx.Response:
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks)
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, text=body)


def ndjson(*chunks: object) -> httpx.Response:
    return httpx.Response(200, text="".join(json.dumps(c) + "\n" for c in chunks))


def raises(error: Exception) -> Job:
    def job(request: httpx.Request) -> httpx.Response:
        raise error

    return job


def answers(response: httpx.Response) -> Job:
    return lambda request: response


def outcome(backend: HttpStreamBackend) -> Done | Failed:
    """Run one prompt job; its final event."""
    try:
        backend.admit("j1", GenerateRequest(prompt="Hello", max_tokens=4))
        events: list[Event] = []
        deadline = time.monotonic() + 20
        while not any(isinstance(e, Done | Failed) for e in events):
            assert time.monotonic() < deadline, events
            events += backend.step(0.2)
        final = events[-1]
        assert isinstance(final, Done | Failed)
        return final
    finally:
        backend.close()


def failure(backend: HttpStreamBackend) -> Failed:
    ev = outcome(backend)
    assert isinstance(ev, Failed), ev
    return ev


LLAMA_SERVER_CASES = [
    # (the server's answer, what the failure says, retryable)
    (answers(httpx.Response(400, json={"error": {"code": 400, "message": "prompt too long"}})),
     "llama-server at http://engine.test:8080 rejected the job (400): prompt too long", False),
    (answers(httpx.Response(503, json={"error": {"message": "Loading model"}})),
     "llama-server at http://engine.test:8080 is unavailable (503): Loading model", True),
    (answers(httpx.Response(500, text="segfault")),
     "llama-server at http://engine.test:8080 failed (HTTP 500): segfault", True),
    (answers(httpx.Response(401, json={"error": {"message": "Invalid API Key"}})),
     "llama-server at http://engine.test:8080 refused the job (HTTP 401): Invalid API Key", False),
    (answers(sse({"content": "Hi", "stop": False}, {"error": {"code": 500, "message": "KV cache full"}})),
     "llama-server at http://engine.test:8080 failed (HTTP 500): KV cache full", True),
    (raises(httpx.ConnectError("connection refused")),
     "llama-server at http://engine.test:8080: cannot connect (connection refused)", True),
    (raises(httpx.ReadTimeout("read timed out")),
     "llama-server at http://engine.test:8080: timed out (ReadTimeout)", True),
    (raises(httpx.RemoteProtocolError("peer closed connection")),
     "llama-server at http://engine.test:8080: connection lost mid-stream "
     "(RemoteProtocolError: peer closed connection)", True),
    (answers(sse({"content": "Hi", "stop": False})),
     "llama-server at http://engine.test:8080: stream ended before the final chunk", True),
    (answers(httpx.Response(200, headers={"content-type": "text/event-stream"}, text="data: {not json\n\n")),
     "llama-server at http://engine.test:8080: unexpected answer (JSONDecodeError", False),
]


@pytest.mark.parametrize(("job", "message", "retryable"), LLAMA_SERVER_CASES)
def test_llama_server_errors_map_to_one_failure_each(job: Job, message: str, retryable: bool) -> None:
    failed = failure(llama_server(job))
    assert failed.error.startswith(message), failed.error
    assert failed.retryable is retryable


def test_llama_server_stream_that_finishes_is_done() -> None:
    done = outcome(llama_server(answers(sse(
        {"content": "Hi", "stop": False},
        {"content": "", "stop": True, "stop_type": "limit", "tokens_evaluated": 2, "tokens_predicted": 1},
    ))))
    assert isinstance(done, Done) and done.finish_reason == "length" and done.completion_tokens == 1


OLLAMA_CASES = [
    (answers(httpx.Response(404, json={"error": "model not found"})),
     "ollama at http://engine.test:8080 has no model 'gemma3:270m' (404): model not found", True),
    (answers(httpx.Response(503, json={"error": "server busy, please try again"})),
     "ollama at http://engine.test:8080 is busy (503): server busy, please try again", True),
    (answers(httpx.Response(400, json={"error": "invalid options"})),
     "ollama at http://engine.test:8080 rejected the job (400): invalid options", False),
    (answers(httpx.Response(500, json={"error": "llama runner process has terminated"})),
     "ollama at http://engine.test:8080 failed (HTTP 500): llama runner process has terminated", True),
    (answers(ndjson({"response": "Hi", "done": False}, {"error": "an error was encountered while running"})),
     "ollama at http://engine.test:8080 failed mid-stream: an error was encountered while running", True),
    (raises(httpx.ConnectError("connection refused")),
     "ollama at http://engine.test:8080: cannot connect (connection refused)", True),
    (answers(httpx.Response(200, text="<html>proxy error</html>\n")),
     "ollama at http://engine.test:8080: unexpected answer (JSONDecodeError", False),
]


@pytest.mark.parametrize(("job", "message", "retryable"), OLLAMA_CASES)
def test_ollama_errors_map_to_one_failure_each(job: Job, message: str, retryable: bool) -> None:
    failed = failure(ollama(job))
    assert failed.error.startswith(message), failed.error
    assert failed.retryable is retryable


def test_ollama_without_the_model_is_unavailable_at_start() -> None:
    pull = r"has no model 'gemma3:270m' \(run `ollama pull gemma3:270m`\)"
    with pytest.raises(BackendUnavailable, match=pull):
        ollama(answers(httpx.Response(500)), show_status=404)


def test_probe_follows_the_health_check() -> None:
    healthy = iter([200, 200, 503])  # start: /health twice ok (ready + probe), then loading again

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(next(healthy), json={})
        return httpx.Response(200, json={"total_slots": 1})

    backend = LlamaServerBackend(LlamaServerSettings(endpoint=ENDPOINT, connect_timeout=2),
                                 transport=httpx.MockTransport(handle))
    try:
        assert backend.probe() is True
        assert backend.probe() is False
    finally:
        backend.close()
