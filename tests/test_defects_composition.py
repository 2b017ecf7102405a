"""Where features meet: a named tenant's job on a worker that dies, a tenant's queued request the
client abandons, RQ's own cancel of a tenant's job. Real redis-server, real `fleet worker`
processes (fake engine: the queue rules are the same for every engine) and a real `fleet serve`;
each test ends with the queue model's invariants (backends/contract/queue/invariants.py)."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import httpx
import pytest
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from backends.contract.keys import tenant_open_key, tenant_queued_key
from backends.contract.queue.invariants import queue_violations
from dispatcher import Fleet
from tests.gateway_harness import Gateways, wait_until_healthy
from tests.harness import wait_for
from tests.reliability_checks import assert_exactly_one_final, final_entries, held
from tests.test_hostile_batch import auth, batch_of, create, jsonl, upload

pytestmark = pytest.mark.timeout(180)

FAKE = {"backend__type": "fake", "backend__slots": 2, "backend__step_delay": 0.05}
TENANTS = {"gamma": {"api_keys": ["key-gamma"], "max_concurrent": 2, "max_queued": 4}}
SETTINGS = {"gateway__tenants": TENANTS}
LONG = " ".join(f"w{i}" for i in range(200))  # the fake engine says the prompt back: 200 steps


def _holder(redis: Redis, job_id: str, names: list[str]) -> str | None:
    return next((n for n in names if job_id in held(redis, n)), None)


def test_a_named_tenants_job_resumes_after_its_worker_is_killed(redis_url: str, redis: Redis,
                                                                workers: Any) -> None:
    w1, w2 = workers.start("w1", **FAKE), workers.start("w2", **FAKE)
    fleet = Fleet(redis_url)
    job = fleet.submit(prompt=LONG, max_tokens=120, tenant="team-b")
    holder = wait_for(lambda: _holder(redis, job.id, ["w1", "w2"]), 30, "a worker to claim the job")
    wait_for(lambda: redis.xlen(f"fleet:stream:{job.id}") > 2, 30, "the job to stream")
    victim = {"w1": w1, "w2": w2}[holder]
    os.kill(victim.process.pid, signal.SIGKILL)
    victim.process.wait(10)
    # the survivor's reaper hands it back to team-b's queue, team-b back in the fair share, and
    # the survivor claims it: without that the job waits until team-b sends another request
    result = job.result(timeout=60)
    assert result["attempt"] == 2 and result["worker"] != holder, result
    assert_exactly_one_final(redis, [job.id])
    assert not queue_violations(redis), queue_violations(redis)


def _stream_then_hang_up(url: str, started: threading.Event, done: threading.Event) -> None:
    """A streamed completion whose client goes away once the request was sent."""
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", f"{url}/v1/completions", headers={"Authorization": "Bearer key-gamma"},
            json={"model": "llm", "prompt": LONG, "max_tokens": 200, "stream": True}) as response:
        started.set()
        done.wait(30)
        response.close()


def test_an_abandoned_queued_request_gives_back_its_tenants_places(redis: Redis, workers: Any,
                                                                   gateways: Gateways) -> None:
    workers.start("w1", **{**FAKE, "backend__slots": 1}, **SETTINGS)
    gw = gateways.start(**SETTINGS)
    wait_until_healthy(gw)
    first_started, first_done = threading.Event(), threading.Event()
    runner = threading.Thread(target=_stream_then_hang_up, args=(gw.url, first_started, first_done))
    runner.start()
    wait_for(lambda: redis.zcard(tenant_open_key("gamma")) == 1, 15, "the first job to be admitted")
    # the second waits behind it (one slot); its client hangs up while it is queued
    second_started, second_done = threading.Event(), threading.Event()
    waiter = threading.Thread(target=_stream_then_hang_up, args=(gw.url, second_started, second_done))
    waiter.start()
    wait_for(lambda: redis.zcard(tenant_queued_key("gamma")) == 1, 15, "the second job to wait in line")
    second_done.set()
    waiter.join(30)
    # the cancelled job lets go of both places at once, not when its reservation expires
    wait_for(lambda: redis.zcard(tenant_open_key("gamma")) == 1, 15,
             "the abandoned job to give back its place")
    assert redis.zcard(tenant_queued_key("gamma")) == 0
    assert not queue_violations(redis), queue_violations(redis)
    # so the tenant, with one job running and max_concurrent 2, is admitted again
    answer = httpx.post(f"{gw.url}/v1/completions", headers={"Authorization": "Bearer key-gamma"}, timeout=60,
                        json={"model": "llm", "prompt": "three", "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    first_done.set()
    runner.join(30)
    wait_for(lambda: not redis.zcard(tenant_open_key("gamma")), 30, "every place to be given back")
    assert not queue_violations(redis), queue_violations(redis)


def test_rqs_own_cancel_of_a_tenants_queued_job_ends_it_and_frees_its_places(
        redis_url: str, redis: Redis, workers: Any) -> None:
    fleet = Fleet(redis_url)
    job = fleet.submit(prompt="a b", max_tokens=4, tenant="team-b")
    # admitted as the gateway admits (its places), then cancelled with RQ's own tools
    redis.zadd(tenant_open_key("team-b"), {job.id: time.time() * 1000 + 3_600_000})
    redis.zadd(tenant_queued_key("team-b"), {job.id: time.time() * 1000 + 3_600_000})
    Job.fetch(job.id, connection=redis, serializer=JSONSerializer).cancel()
    workers.start("w1", **FAKE)  # its housekeeping ends the job: a final entry, places let go
    assert job.result(timeout=30)["finish_reason"] == "cancelled"
    assert len(final_entries(redis, job.id)) == 1  # (no RQ result: like a queued job the fleet cancels)
    wait_for(lambda: not redis.exists(tenant_open_key("team-b"), tenant_queued_key("team-b")), 15,
             "team-b's places to be let go")
    assert not queue_violations(redis), queue_violations(redis)


def test_a_tenants_batches_pass_its_batch_quota_not_around_its_limits(redis: Redis, workers: Any,
                                                                      gateways: Gateways) -> None:
    """A batch is admitted whole and its lines run for hours, so they do not pass the interactive
    limits one by one: a limited tenant has a batch quota of its own (max_batch_lines), and
    without one it runs no batches at all."""
    tenants = {"capped": {"api_keys": ["key-capped"], "requests_per_minute": 10, "max_queued": 1},
               "quota": {"api_keys": ["key-quota"], "requests_per_minute": 10, "max_batch_lines": 5}}
    settings = {"gateway__tenants": tenants}
    workers.start("w1", **{**FAKE, "backend__step_delay": 0.2}, **settings)
    gw = gateways.start(**settings)
    wait_until_healthy(gw)
    # the operator's report: rpm 10, max_queued 1, and a 30-line batch ran
    refused = create(gw.url, upload(gw.url, jsonl(30), "key-capped").json()["id"], "key-capped")
    assert refused.status_code == 400, refused.text
    assert "max_batch_lines" in refused.json()["error"]["message"]
    assert not redis.exists("fleet:batches:open:llm") or not redis.hlen("fleet:batches:open:llm")
    # a batch larger than the quota can never run: 400; within it, a second one waits its turn: 429
    too_big = create(gw.url, upload(gw.url, jsonl(6), "key-quota").json()["id"], "key-quota")
    assert too_big.status_code == 400 and too_big.json()["error"]["code"] == "batch_quota_exceeded"
    first = batch_of(gw.url, jsonl(4, max_tokens=20, prompt=LONG), "key-quota")
    second = create(gw.url, upload(gw.url, jsonl(2), "key-quota").json()["id"], "key-quota")
    assert second.status_code == 429, second.text
    assert second.json()["error"]["type"] == "requests" and int(second.headers["Retry-After"]) >= 1
    wait_for(lambda: httpx.get(f"{gw.url}/v1/batches/{first['id']}", headers=auth("key-quota"),
                               timeout=10).json()["status"] == "completed", 60, "the first batch to end")
    assert batch_of(gw.url, jsonl(2), "key-quota")["status"] in ("validating", "in_progress", "completed")
    assert not queue_violations(redis), queue_violations(redis)


RECURSIVE = {"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                       "required": ["x"]}},
             "$ref": "#/$defs/a"}


def test_a_schema_no_finite_answer_satisfies_is_refused(workers: Any, gateways: Gateways) -> None:
    """A `$ref` that requires itself with no way out could only run to max_tokens: 400 up front,
    for structured output and for a tool's parameters; a recursive schema with a way out runs."""
    workers.start("w1", **FAKE)
    gw = gateways.start()
    wait_until_healthy(gw)
    chat = {"model": "llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    shaped = {**chat, "response_format": {"type": "json_schema",
                                          "json_schema": {"name": "a", "schema": RECURSIVE}}}
    tools = {**chat, "tools": [{"type": "function", "function": {"name": "f", "parameters": RECURSIVE}}]}
    for body in (shaped, tools):
        answer = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30)
        assert answer.status_code == 400, answer.text
        assert "no finite JSON satisfies the schema" in answer.json()["error"]["message"]
    tree = {"$defs": {"n": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
        "next": {"$ref": "#/$defs/n"}}, "required": ["next"]}]}}, "$ref": "#/$defs/n"}
    fine = {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": tree}}}
    assert httpx.post(f"{gw.url}/v1/chat/completions", json=fine, timeout=60).status_code == 200


def test_a_tenants_request_for_a_catalogue_model_survives_its_workers_death(redis: Redis, workers: Any,
                                                                            gateways: Gateways) -> None:
    """The model catalogue with tenants and placement on: a tenant's request for a model that no
    worker holds yet is loaded by one worker; that worker is killed mid-stream; the survivor
    loads the model, finishes the job (attempt 2) and the tenant's places are given back. (Fake
    engine: the shelf gives each model an engine of its own, the queue rules are the real ones.)"""
    models = {"chat:1b": {"path": "/models/chat.gguf"}, "coder:1b": {"path": "/models/coder.gguf"}}
    started = [workers.start(n, **FAKE, models=models, **SETTINGS) for n in ("w1", "w2")]
    gw = gateways.start(models=models, **SETTINGS)
    wait_until_healthy(gw)
    answer: dict[str, Any] = {}

    def ask() -> None:
        answer["r"] = httpx.post(f"{gw.url}/v1/completions", headers={"Authorization": "Bearer key-gamma"},
                                 json={"model": "coder:1b", "prompt": LONG, "max_tokens": 150}, timeout=120)

    asking = threading.Thread(target=ask)
    asking.start()
    key = "fleet:copies:coder-1b"
    holder = wait_for(lambda: next((n.decode() for n in redis.hkeys(key)), None), 30, "a worker to load it")
    assert redis.hlen(key) == 1  # loaded once
    victim = {w.name: w for w in started}[holder]
    time.sleep(0.5)  # mid-stream
    os.kill(victim.process.pid, signal.SIGKILL)
    victim.process.wait(10)
    asking.join(120)
    reply = answer["r"]
    assert reply.status_code == 200, reply.text
    survivor = next(w.name for w in started if w.name != holder)
    assert reply.json()["choices"][0]["text"]
    wait_for(lambda: [n.decode() for n in redis.hkeys(key)] == [survivor], 15, "the survivor to hold it")
    wait_for(lambda: not redis.zcard(tenant_open_key("gamma")), 30, "the tenant's places to be given back")
    assert not queue_violations(redis), queue_violations(redis)


def test_a_tenants_burst_gets_a_second_copy_that_survives_the_first_holders_death(
        redis: Redis, workers: Any, gateways: Gateways) -> None:
    """A second copy of a hot catalogue model with tenants and placement on: a tenant's burst
    keeps the first holder full, the idle worker loads the model too and takes a share; the
    first holder is killed mid-stream; every request still answers, the survivor alone holds the
    model, the tenant's places are given back and the queue invariants hold."""
    tenants = {"delta": {"api_keys": ["key-delta"], "max_concurrent": 6, "max_queued": 8}}
    models = {"chat:1b": {"path": "/models/chat.gguf"}}
    started = {n: workers.start(n, **FAKE, models=models, second_copy_after=1.0, gateway__tenants=tenants)
               for n in ("w1", "w2")}
    gw = gateways.start(models=models, gateway__tenants=tenants)
    wait_until_healthy(gw)
    replies: list[httpx.Response] = []

    def ask() -> None:
        replies.append(httpx.post(f"{gw.url}/v1/completions", headers={"Authorization": "Bearer key-delta"},
                                  json={"model": "chat:1b", "prompt": LONG, "max_tokens": 150}, timeout=150))

    asking = [threading.Thread(target=ask) for _ in range(6)]
    for t in asking:
        t.start()
    key = "fleet:copies:chat-1b"
    first = wait_for(lambda: next((n.decode() for n in redis.hkeys(key)), None), 30, "a worker to load it")
    wait_for(lambda: redis.hlen(key) == 2, 30, "the idle worker to load a second copy")
    survivor = next(n for n in started if n != first)
    wait_for(lambda: held(redis, survivor), 10, "the second copy to take a job")
    os.kill(started[first].process.pid, signal.SIGKILL)
    started[first].process.wait(10)
    for t in asking:
        t.join(150)
    assert [r.status_code for r in replies] == [200] * 6, [r.text for r in replies if r.status_code != 200]
    assert all(r.json()["choices"][0]["text"] for r in replies)
    wait_for(lambda: redis.hkeys(key) == [survivor.encode()], 15, "the survivor alone to hold it")
    wait_for(lambda: not redis.zcard(tenant_open_key("delta")), 30, "the tenant's places to be given back")
    assert not queue_violations(redis), queue_violations(redis)
