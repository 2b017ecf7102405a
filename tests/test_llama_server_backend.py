"""LlamaServerBackend against a real llama-server (`--parallel 4`, the real model), driven the way the
worker drives it: admit while free_slots() > 0, then step()."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backends.base import BackendUnavailable, Done, Event, Failed, JobRejected, Restarted, Token
from backends.contract.schema import GenerateRequest, Message
from backends.fallback import FallbackBackend
from backends.http_settings import LlamaServerSettings
from backends.llama_server import LlamaServerBackend
from tests.real_servers import LlamaServer, free_port, llama_server, model_path

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    with llama_server(tmp_path_factory.mktemp("llama-server"), parallel=4, ctx=4096) as s:
        yield s


@pytest.fixture
def backend(server: LlamaServer) -> Iterator[LlamaServerBackend]:
    b = LlamaServerBackend(LlamaServerSettings(endpoint=server.url, connect_timeout=10))
    yield b
    b.close()


def greedy(**kw: object) -> GenerateRequest:
    return GenerateRequest.model_validate({"temperature": 0.0, "seed": 7, **kw})


def collect(backend: LlamaServerBackend | FallbackBackend, n_jobs: int, deadline: float = 90) -> list[Event]:
    """Step until `n_jobs` jobs have ended."""
    events: list[Event] = []
    ended = 0
    stop = time.monotonic() + deadline
    while ended < n_jobs:
        assert time.monotonic() < stop, f"only {ended}/{n_jobs} jobs ended; events: {events[-5:]}"
        batch = backend.step(0.5)
        ended += sum(isinstance(e, Done | Failed) for e in batch)
        events += batch
    return events


def text(events: list[Event], job_id: str) -> str:
    return "".join(e.text for e in events if isinstance(e, Token) and e.job_id == job_id)


def final(events: list[Event], job_id: str) -> Done | Failed:
    (end,) = [e for e in events if isinstance(e, Done | Failed) and e.job_id == job_id]
    return end


@pytest.mark.model
def test_slot_count_comes_from_the_server_and_parallel_caps_it(server: LlamaServer) -> None:
    full = LlamaServerBackend(LlamaServerSettings(endpoint=server.url))
    capped = LlamaServerBackend(LlamaServerSettings(endpoint=server.url, parallel=2))
    try:
        assert (full.slots, full.free_slots(), capped.slots) == (4, 4, 2)
        assert full.stats()["server_slots"] == 4
    finally:
        full.close()
        capped.close()


@pytest.mark.model
def test_eight_jobs_run_four_at_a_time_on_the_server(
    server: LlamaServer, backend: LlamaServerBackend
) -> None:
    waiting = [f"job{i}" for i in range(8)]
    busy_seen: list[int] = []
    watching = threading.Event()

    def watch_server_slots() -> None:  # what the server itself says is processing
        while not watching.is_set():
            slots = httpx.get(f"{server.url}/slots", timeout=5).json()
            busy_seen.append(sum(bool(s["is_processing"]) for s in slots))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_server_slots)
    watcher.start()
    events: list[Event] = []
    max_in_flight = 0
    in_flight: set[str] = set()
    try:
        while waiting or in_flight:
            while waiting and backend.free_slots() > 0:
                job = waiting.pop(0)
                backend.admit(job, greedy(prompt=f"Item {job}: a list of fruits:", max_tokens=24))
                in_flight.add(job)
            max_in_flight = max(max_in_flight, len(in_flight))
            if backend.free_slots() == 0:
                with pytest.raises(RuntimeError, match="no free slot"):
                    backend.admit("one-too-many", greedy(prompt="x"))
            for ev in backend.step(0.5):
                events.append(ev)
                if isinstance(ev, Done | Failed):
                    in_flight.discard(ev.job_id)
    finally:
        watching.set()
        watcher.join()
    assert max_in_flight == 4
    assert max(busy_seen) == 4, busy_seen  # the server really ran four at once
    for i in range(8):
        end = final(events, f"job{i}")
        assert isinstance(end, Done) and end.finish_reason in ("stop", "length")
        assert end.prompt_tokens > 0 and end.completion_tokens > 0
        assert "predicted_per_second" in end.extra["timings"]  # type: ignore[operator]
    assert backend.stats()["completed"] == 8


@pytest.mark.model
def test_streamed_deltas_concatenate_to_the_servers_own_text(
    server: LlamaServer, backend: LlamaServerBackend
) -> None:
    request = greedy(prompt="The three primary colours are", max_tokens=20)
    ask = {"prompt": request.prompt, "n_predict": 20, "temperature": 0.0, "seed": 7, "stream": False}
    # the server's prompt cache decides how many prompt tokens a request evaluates (a cold one: all),
    # and a prompt evaluated in another shape can round differently, which flips this answer's
    # near-ties (0.14 nats at " blue"): both compared answers are repeats, evaluated alike
    httpx.post(f"{server.url}/completion", json=ask, timeout=120)
    backend.admit("stream", request)
    events = collect(backend, 1)
    deltas = [e for e in events if isinstance(e, Token)]
    assert len(deltas) > 3  # streamed piece by piece, not in one lump
    direct = httpx.post(f"{server.url}/completion", json=ask, timeout=120).json()
    done = final(events, "stream")
    assert isinstance(done, Done) and isinstance(timings := done.extra["timings"], dict)
    assert timings["prompt_n"] == direct["timings"]["prompt_n"]
    assert text(events, "stream") == direct["content"]
    assert isinstance(done, Done) and done.completion_tokens == direct["tokens_predicted"]


@pytest.mark.model
def test_stop_strings_end_the_job_before_the_stop_text(backend: LlamaServerBackend) -> None:
    backend.admit("count", greedy(prompt="Counting: 1, 2, 3, 4, 5,", max_tokens=40, stop=[" 8"]))
    events = collect(backend, 1)
    done = final(events, "count")
    assert isinstance(done, Done) and done.finish_reason == "stop"
    assert done.extra["stop_type"] == "word" and done.extra["stop_word"] == " 8"
    assert text(events, "count") == " 6, 7,"


@pytest.mark.model
def test_max_tokens_ends_with_length_and_exact_count(backend: LlamaServerBackend) -> None:
    backend.admit("short", greedy(prompt="Once upon a time, in a land far away,", max_tokens=7))
    backend.admit("chat", greedy(messages=[Message(role="user", content="Name a colour.")], max_tokens=5))
    events = collect(backend, 2)
    for job in ("short", "chat"):
        done = final(events, job)
        assert isinstance(done, Done) and done.finish_reason == "length", done
        assert done.completion_tokens == (7 if job == "short" else 5)
        assert done.prompt_tokens > 0 and text(events, job)


@pytest.mark.model
def test_cancel_ends_the_job_and_frees_the_slot(server: LlamaServer, backend: LlamaServerBackend) -> None:
    backend.admit("long", greedy(prompt="Write a very long story about a dragon.", max_tokens=2000))
    events: list[Event] = []
    while not any(isinstance(e, Token) for e in events):
        events += backend.step(1.0)
    backend.cancel("long")
    started = time.monotonic()
    events = backend.step(20.0)
    assert time.monotonic() - started < 10  # the cancel ends the step at once, not its wait
    assert [e for e in events if not isinstance(e, Token)] == [
        Done("long", "cancelled", prompt_tokens=0, completion_tokens=events[-1].completion_tokens)  # type: ignore[union-attr]
    ]
    assert backend.free_slots() == 4
    deadline = time.monotonic() + 10  # the server drops the request when the stream closes
    while any(s["is_processing"] for s in httpx.get(f"{server.url}/slots").json()):
        assert time.monotonic() < deadline, "llama-server still generating for a cancelled job"
        time.sleep(0.1)
    assert backend.step(0.2) == []  # nothing late leaks out of the cancelled stream


@pytest.mark.model
def test_prompt_longer_than_the_context_fails_for_good_with_the_servers_message(
    backend: LlamaServerBackend,
) -> None:
    backend.admit("huge", greedy(prompt="word " * 1500, max_tokens=4))
    end = final(collect(backend, 1), "huge")
    assert isinstance(end, Failed) and end.retryable is False
    assert "(400)" in end.error and "exceeds the available context size" in end.error


def test_unreachable_server_is_backend_unavailable_after_connect_timeout() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(BackendUnavailable, match=r"llama-server at .* not ready after 1s"):
        LlamaServerBackend(LlamaServerSettings(endpoint=url, connect_timeout=1))
    assert time.monotonic() - started < 3


@pytest.mark.model
def test_backend_waits_while_the_server_loads(tmp_path: Path) -> None:
    with llama_server(tmp_path, parallel=2, ctx=1024, wait=False) as starting:
        b = LlamaServerBackend(
            LlamaServerSettings(endpoint=starting.url, connect_timeout=60)
        )
        try:
            assert b.slots == 2
        finally:
            b.close()


@pytest.mark.model
def test_server_killed_mid_job_fails_retryable_then_fallback_reruns_it(tmp_path: Path) -> None:
    from tests.ollama_api_server import serve

    ollama = serve(str(model_path()), names=("gemma3:270m",))
    try:
        with llama_server(tmp_path, parallel=2, ctx=2048) as victim:
            # 1. alone: the job fails, retryable, with a clear message
            alone = LlamaServerBackend(LlamaServerSettings(endpoint=victim.url))
            alone.admit("a", greedy(prompt="Tell me a long story.", max_tokens=500))
            events: list[Event] = []
            while sum(isinstance(e, Token) for e in events) < 2:
                events += alone.step(1.0)
            victim.kill()
            end = final(events + collect(alone, 1), "a")
            assert isinstance(end, Failed) and end.retryable, end
            assert "llama-server at" in end.error and "mid-stream" in end.error
            alone.close()

        with llama_server(tmp_path, parallel=2, ctx=2048) as victim:
            # 2. in a chain: the same crash restarts the job on the Ollama backend
            from backends.registry import backend_settings, make_backend

            settings = backend_settings({
                "type": "llama-server",
                "endpoint": victim.url,
                "fallback": [{"type": "ollama", "endpoint": ollama.url, "model": "gemma3:270m"}],
            })

            chain = make_backend(settings)
            assert isinstance(chain, FallbackBackend)
            chain.admit("b", greedy(prompt="Tell me a long story.", max_tokens=12))
            events = []
            while sum(isinstance(e, Token) for e in events) < 2:
                events += chain.step(1.0)
            victim.kill()
            events += collect(chain, 1)
            kinds = [type(e) for e in events]
            restart = kinds.index(Restarted)
            assert all(k is Token for k in kinds[:restart])
            assert "restarted on ollama@" in events[restart].reason  # type: ignore[union-attr]
            done = final(events, "b")
            assert isinstance(done, Done) and done.finish_reason == "length" and done.completion_tokens == 12
            assert text(events[restart:], "b")  # the text after the restart came from Ollama
            members = chain.stats()["members"]
            assert isinstance(members, list)
            assert members[0]["healthy"] is False and members[1]["healthy"] is True
            assert chain.free_slots() == 1  # new jobs now go to Ollama (parallel 1)
            chain.close()
    finally:
        ollama.shutdown()


@pytest.mark.model
def test_ignore_eos_reaches_max_tokens_and_min_tokens_is_refused_by_name(backend: LlamaServerBackend) -> None:
    stops = "#include <stdio.h>\nint main() { return 0; }\n"  # the model's first token is <eos>
    backend.admit("plain", greedy(prompt=stops, max_tokens=24))
    backend.admit("all", greedy(prompt=stops, max_tokens=24, ignore_eos=True))
    events = collect(backend, 2)
    plain, to_the_end = final(events, "plain"), final(events, "all")
    assert isinstance(plain, Done) and plain.completion_tokens < 24 and plain.finish_reason == "stop"
    assert isinstance(to_the_end, Done) and to_the_end.finish_reason == "length"
    assert to_the_end.completion_tokens == 24
    with pytest.raises(JobRejected, match="min_tokens: not supported by the llama-server backend"):
        backend.admit("min", greedy(prompt=stops, max_tokens=24, min_tokens=8))
    assert backend.free_slots() == backend.slots  # nothing was taken
