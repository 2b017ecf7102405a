"""Workers on the HTTP backends, end to end through real parts: redis-server, `fleet worker`
processes, a real `llama-server --parallel 4` on the real model, the Ollama-API test server.

Jobs go in through `Fleet.submit` and come out through `stream()` / `result()`, exactly as a
producer sees them; the server is watched through its own `/slots`."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama as ollama_client
import openai
import pytest
from redis import Redis

from backends.contract.keys import stream_key
from dispatcher import Fleet, JobFailed
from tests.gateway_harness import wait_until_healthy
from tests.harness import ROOT, WorkerProcess, wait_for
from tests.ollama_api_server import OllamaApiServer, serve
from tests.real_servers import LlamaServer, llama_server, model_path

pytestmark = [pytest.mark.timeout(240), pytest.mark.model]
STORY = "Write a very long story about a dragon who learns to read."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    with llama_server(tmp_path_factory.mktemp("llama-server"), parallel=4, ctx=4096) as s:
        yield s


def start_server_worker(workers, name: str, url: str, **settings: object) -> WorkerProcess:
    return workers.start(name, backend__type="llama-server", backend__endpoint=url,
                         backend__connect_timeout=30, **settings)


def busy_slots(url: str) -> int:
    return sum(bool(s["is_processing"]) for s in httpx.get(f"{url}/slots", timeout=5).json())


class Watcher(threading.Thread):
    """Samples the server's busy slots and the worker's started jobs every 20 ms."""

    def __init__(self, url: str, redis: Redis) -> None:
        super().__init__(daemon=True)
        self.url, self.redis = url, redis
        self.busy: list[int] = []
        self.started: list[int] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.02):
            self.busy.append(busy_slots(self.url))
            self.started.append(int(self.redis.zcard("rq:wip:llm:default")))

    def __enter__(self) -> Watcher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.halt.set()
        self.join()


def fleet_status(redis_url: str) -> dict[str, dict[str, object]]:
    """`fleet status --json`, workers by name."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env["FLEET_REDIS_URL"] = redis_url
    out = subprocess.run([str(ROOT / ".venv/bin/fleet"), "status", "--json"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout
    return {w["name"]: w for w in json.loads(out)["workers"]}


def first_delta(job) -> None:  # type: ignore[no-untyped-def]
    """Block until the job has streamed its first text."""
    next(iter(job.stream(timeout=60, detach=True)))  # only a peek: leaving it must not cancel


# -- llama-server: concurrency, streaming, stop, max_tokens, cancel -------------------------------


def test_eight_jobs_run_four_at_a_time_on_the_server(redis_url: str, redis: Redis, workers,
                                                     server: LlamaServer) -> None:
    start_server_worker(workers, "w-srv", server.url)
    fleet = Fleet(redis_url)
    with Watcher(server.url, redis) as watch:
        jobs = [fleet.submit(prompt=f"Story {i}: once upon a time,", max_tokens=40, temperature=0.0)
                for i in range(8)]
        results = [j.result(timeout=120) for j in jobs]
    assert max(watch.busy) == 4, watch.busy  # the server really ran four at once ...
    assert max(watch.started) == 4, watch.started  # ... and the worker never held more than its slots
    for r in results:
        assert (r["worker"], r["backend"], r["attempt"]) == ("w-srv", "llama-server", 1)
        assert r["finish_reason"] in ("length", "stop") and r["usage"]["completion_tokens"] > 0
        assert r["usage"]["prompt_tokens"] > 0 and r["text"]
    # the last four waited in the queue for a slot
    queue_ms = sorted(r["timings"]["queue_ms"] for r in results)
    assert queue_ms[-1] > queue_ms[0] + 50


def test_streaming_max_tokens_and_stop_strings(redis_url: str, workers, server: LlamaServer) -> None:
    start_server_worker(workers, "w-srv", server.url)
    fleet = Fleet(redis_url)
    job = fleet.submit(prompt="Counting: 1, 2, 3, 4, 5,", max_tokens=12, temperature=0.0)
    deltas = list(job.stream(timeout=60))
    res = job.result(timeout=10)
    assert len(deltas) > 3 and "".join(deltas) == res["text"]  # streamed piece by piece
    assert res["finish_reason"] == "length" and res["usage"]["completion_tokens"] == 12
    assert res["text"].startswith(" 6, 7,")

    stopped = fleet.submit(prompt="Counting: 1, 2, 3, 4, 5,", max_tokens=40, temperature=0.0, stop=[" 8"])
    assert "".join(stopped.stream(timeout=60)) == " 6, 7,"
    res = stopped.result(timeout=10)
    assert res["text"] == " 6, 7," and res["finish_reason"] == "stop"

    chat = fleet.submit(messages=[{"role": "user", "content": "Name a colour."}], max_tokens=5,
                        temperature=0.0)
    res = chat.result(timeout=60)
    assert res["finish_reason"] == "length" and res["usage"]["completion_tokens"] == 5 and res["text"]


def test_cancel_stops_the_server_and_the_slot_takes_the_next_job(redis_url: str, workers,
                                                                 server: LlamaServer) -> None:
    start_server_worker(workers, "w-srv", server.url, backend__parallel=1)  # one slot: the next job waits
    fleet = Fleet(redis_url)
    long = fleet.submit(prompt=STORY, max_tokens=900, temperature=0.0)
    nxt = fleet.submit(prompt="The sky is", max_tokens=6, temperature=0.0)
    first_delta(long)
    assert long.cancel() == "cancelling"
    res = long.result(timeout=30)
    assert res["finish_reason"] == "cancelled" and res["usage"]["completion_tokens"] < 900
    assert nxt.result(timeout=60)["finish_reason"] == "length"
    wait_for(lambda: busy_slots(server.url) == 0, 10, "llama-server to drop the cancelled request")


# -- a server that dies mid-job -------------------------------------------------------------------


def test_server_killed_mid_job_requeues_it_and_the_job_finishes_when_the_server_is_back(
    redis_url: str, workers, tmp_path: Path
) -> None:
    victim = llama_server(tmp_path, parallel=2, ctx=2048)
    with victim:
        w = start_server_worker(workers, "w-lone", victim.url)
        fleet = Fleet(redis_url)
        job = fleet.submit(prompt=STORY, max_tokens=120, temperature=0.0)
        first_delta(job)
        victim.kill()
        # a transport failure is the engine's fault: the job goes back to the queue (for any worker
        # of the pool) and this worker stops claiming until its engine answers again
        wait_for(lambda: job.status() == "queued", 30, "the job to be requeued")
        assert w.alive() and fleet_status(redis_url)["w-lone"]["state"] != "stopped"
    with llama_server(tmp_path, parallel=2, ctx=2048, port=victim.port):  # back on the same port
        res = job.result(timeout=120)
    assert (res["backend"], res["worker"], res["attempt"]) == ("llama-server", "w-lone", 2)
    assert res["usage"]["completion_tokens"] == 120 and w.alive()


def test_server_killed_mid_job_fails_it_clearly_when_no_attempt_is_left(
    redis_url: str, workers, tmp_path: Path
) -> None:
    with llama_server(tmp_path, parallel=2, ctx=2048) as victim:
        w = start_server_worker(workers, "w-once", victim.url, max_attempts=1)
        job = Fleet(redis_url).submit(prompt=STORY, max_tokens=300, temperature=0.0)
        first_delta(job)
        victim.kill()
        with pytest.raises(JobFailed, match=r"llama-server at http://127\.0\.0\.1:\d+: connection lost") as e:
            job.result(timeout=30)
        assert e.value.details["worker"] == "w-once"
        assert w.alive() and "w-once" in fleet_status(redis_url)


def test_server_killed_mid_job_retries_it_on_the_fallback_then_recovers(
    redis_url: str, workers, tmp_path: Path
) -> None:
    victim = llama_server(tmp_path, parallel=2, ctx=2048)
    fallback = [{"type": "llama-cpp", "slots": 2, "n_ctx": 2048, "n_ctx_per_seq": 1024}]
    with victim:
        w = start_server_worker(workers, "w-fb", victim.url, backend__fallback=fallback)
        assert fleet_status(redis_url)["w-fb"]["backend"] == "llama-server>llama-cpp"
        fleet = Fleet(redis_url)
        job = fleet.submit(prompt=STORY, max_tokens=48, temperature=0.0)
        first_delta(job)
        victim.kill()
        res = job.result(timeout=120)
        assert (res["backend"], res["worker"], res["finish_reason"]) == ("llama-cpp", "w-fb", "length")
        assert res["attempt"] == 2  # the llama-server attempt's partial text is void
        assert res["usage"]["completion_tokens"] == 48
        raw = Redis.from_url(redis_url).xrange(stream_key(job.id))
        assert {int(f[b"a"]) for _id, f in raw if f[b"k"] == b"t"} == {1, 2}  # both attempts streamed
        # the primary rests: the next job goes straight to the fallback
        assert fleet.submit(prompt="Hi", max_tokens=4).result(timeout=60)["backend"] == "llama-cpp"
        assert w.alive()
    with llama_server(tmp_path, parallel=2, ctx=2048, port=victim.port):
        # after its backoff (1 s) a probe finds the primary again
        def served_by_server() -> bool:
            res = fleet.submit(prompt="Hi", max_tokens=4, temperature=0.0).result(timeout=60)
            return res["backend"] == "llama-server"

        wait_for(served_by_server, 30, "jobs to go back to llama-server", interval=0.5)


# -- A/B: two backends in one pool ----------------------------------------------------------------


def test_ab_two_backends_in_one_pool_results_say_who_served(redis_url: str, workers,
                                                            server: LlamaServer) -> None:
    workers.start("w-cpp", backend__type="llama-cpp", backend__slots=4, backend__n_ctx=2048,
                  backend__n_ctx_per_seq=512)
    start_server_worker(workers, "w-srv", server.url)
    status = fleet_status(redis_url)
    assert {n: status[n]["backend"] for n in status} == {"w-cpp": "llama-cpp", "w-srv": "llama-server"}
    assert status["w-srv"]["slots"] == 4 and status["w-cpp"]["slots"] == 4

    fleet = Fleet(redis_url)
    # eight long-enough jobs and 4 + 4 slots: both workers must take some
    jobs = [fleet.submit(prompt=f"Tale {i}: long ago,", max_tokens=32, temperature=0.0) for i in range(8)]
    results = [j.result(timeout=150) for j in jobs]
    served = {(r["worker"], r["backend"]) for r in results}
    assert served == {("w-cpp", "llama-cpp"), ("w-srv", "llama-server")}
    assert all(r["usage"]["completion_tokens"] > 0 for r in results)
    by_worker = {name: sum(r["worker"] == name for r in results) for name in ("w-cpp", "w-srv")}

    def status_counts() -> bool:  # the status hash catches up within a heartbeat
        return {n: w["jobs_done"] for n, w in fleet_status(redis_url).items()} == by_worker

    wait_for(status_counts, 10, "fleet status to count each worker's jobs", interval=0.5)


# -- Ollama ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ollama() -> Iterator[OllamaApiServer]:
    s = serve(str(model_path()), names=("gemma3:270m",), parallel=1, max_queue=1)
    yield s
    s.shutdown()


def test_ollama_worker_generates_chats_and_streams(redis_url: str, workers, ollama: OllamaApiServer) -> None:
    workers.start("w-oll", backend__type="ollama", backend__endpoint=ollama.url, backend__model="gemma3:270m")
    assert fleet_status(redis_url)["w-oll"]["backend"] == "ollama"
    fleet = Fleet(redis_url)
    gen = fleet.submit(prompt="Counting: 1, 2, 3, 4, 5,", max_tokens=8, temperature=0.0, seed=1)
    chat = fleet.submit(messages=[{"role": "user", "content": "Say hello."}], max_tokens=6, temperature=0.0)
    stopped = fleet.submit(prompt="Counting: 1, 2, 3, 4, 5,", max_tokens=40, temperature=0.0, stop=[" 8"])
    deltas = list(gen.stream(timeout=60))
    res = gen.result(timeout=10)
    assert len(deltas) > 3 and "".join(deltas) == res["text"] and res["text"].startswith(" 6, 7,")
    assert (res["backend"], res["worker"], res["finish_reason"]) == ("ollama", "w-oll", "length")
    assert res["usage"]["completion_tokens"] == 8 and res["usage"]["prompt_tokens"] > 0
    res = chat.result(timeout=60)
    assert res["finish_reason"] == "length" and res["usage"]["completion_tokens"] == 6 and res["text"]
    res = stopped.result(timeout=60)
    assert res["text"] == " 6, 7," and res["finish_reason"] == "stop"


def test_ollama_error_line_mid_stream_fails_the_job_clearly(redis_url: str, workers,
                                                            ollama: OllamaApiServer) -> None:
    workers.start("w-oll", backend__type="ollama", backend__endpoint=ollama.url, backend__model="gemma3:270m")
    ollama.error_after = 3
    try:
        job = Fleet(redis_url).submit(prompt="Once upon a time", max_tokens=30, temperature=0.0)
        with pytest.raises(JobFailed, match=r"ollama at .* failed mid-stream") as e:
            job.result(timeout=60)
        assert e.value.details["attempt"] == 3  # an engine fault: retried up to max_attempts, then failed
    finally:
        ollama.error_after = None


def test_a_thinking_model_behind_ollama_gives_its_thoughts_apart(workers, gateways,
                                                                 ollama: OllamaApiServer) -> None:
    """A thinking model on Ollama (the test server with `thinking`: Ollama's capability, `think`,
    its split of the output into `message.thinking`). The worker says its model thinks, so the
    gateway asks for thoughts apart; the backend sends `think` and streams Ollama's thinking as the
    answer's reasoning: the official ollama client gets `thinking`, whole and streamed, the openai
    client `reasoning_content`; `think: false` turns the thought off. (The small model never ends
    a thought it is put in: all of its tokens are thought.)"""
    ollama.thinking = True  # the module's server, its model loaded once; set before the worker asks
    try:
        workers.start("w-think", backend__type="ollama", backend__endpoint=ollama.url,
                      backend__model="gemma3:270m")
        gw = gateways.start()
        wait_until_healthy(gw)
        ask = [{"role": "user", "content": "Write one sentence about the sea."}]
        options = {"num_predict": 12, "temperature": 0}
        client = ollama_client.Client(host=gw.url)
        whole = client.chat(model="llm", messages=ask, think=True, options=options)
        assert whole.message.thinking and not whole.message.content
        streamed = list(client.chat(model="llm", messages=ask, think=True, options=options, stream=True))
        assert "".join(c.message.thinking or "" for c in streamed) == whole.message.thinking
        assert not "".join(c.message.content or "" for c in streamed)
        off = client.chat(model="llm", messages=ask, think=False, options=options)
        assert off.message.content and not off.message.thinking  # (the small model parrots tags)

        oa = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        answer = oa.chat.completions.create(model="llm", messages=ask, max_tokens=12, temperature=0)
        message = answer.choices[0].message
        assert (message.model_extra or {}).get("reasoning_content") == whole.message.thinking
        assert not message.content
    finally:
        ollama.thinking = False
