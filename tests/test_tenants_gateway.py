"""Tenants through real `fleet serve` processes and real `fleet worker`s (fake engine, real
redis-server): each limit answers 429 at its count and recovers, two gateways together never pass
`max_concurrent`, a tenant sees only its own batches and files, operators see (and delete) all,
usage counts what the results report, a plain-RQ tenant job is counted, `max_priority` and `models` hold."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis
from rq import Queue

from backends.contract.keys import job_key, tenant_queued_key
from dispatcher import Fleet
from dispatcher.plans import run
from dispatcher.tenants import usage_plan
from tests.gateway_harness import Gateways, wait_until_healthy
from tests.harness import ROOT, wait_for
from tests.observe_helpers import cli_env
from tests.test_hostile_batch import auth, batch_of, jsonl

FAKE = {"backend__type": "fake", "backend__slots": 8}
TENANTS = {
    # a limited tenant runs batches only with a batch quota of its own
    "alpha": {"api_keys": ["key-alpha"], "requests_per_minute": 3, "max_batch_lines": 100},
    "beta": {"api_keys": ["key-beta"], "tokens_per_minute": 10},
    "gamma": {"api_keys": ["key-gamma"], "max_concurrent": 2},
    "delta": {"api_keys": ["key-delta"], "max_queued": 1},
    "low": {"api_keys": ["key-low"], "max_priority": "low", "models": ["llm"]},
}
SETTINGS = {"gateway__tenants": TENANTS, "gateway__admin_keys": ["key-admin"],
            "gateway__models": {"llm": "llm", "other": "llm"}}


def complete(url: str, key: str, prompt: str = "one two three", max_tokens: int = 3, model: str = "llm",
             headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers={**auth(key), **(headers or {})}, timeout=60,
                      json={"model": model, "prompt": prompt, "max_tokens": max_tokens})


def refused(response: httpx.Response, limit: str) -> int:
    """The Retry-After of a 429 naming `limit` in OpenAI's error shape."""
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["param"] == limit, error
    assert error["type"] == ("tokens" if limit == "tokens_per_minute" else "requests"), error  # OpenAI's
    assert limit in error["message"]
    return int(response.headers["Retry-After"])


def test_each_limit_answers_429_at_its_count_and_recovers(redis: Redis, workers: Any,
                                                          gateways: Gateways) -> None:
    workers.start("w1", **FAKE, **SETTINGS)
    gw = gateways.start(**SETTINGS)
    wait_until_healthy(gw)
    # the counts are per minute of Redis's clock: start early in one, so the checks share it
    if (second := int(redis.time()[0]) % 60) > 40:
        time.sleep(61 - second)
    # requests_per_minute 3: the 4th request this minute is refused
    for _ in range(3):
        assert complete(gw.url, "key-alpha").status_code == 200
    waits = [refused(complete(gw.url, "key-alpha"), "requests_per_minute")]
    # tokens_per_minute 10: admitted until the tokens used this minute reach 10
    used = 0
    while used < 10:
        answer = complete(gw.url, "key-beta")
        assert answer.status_code == 200, answer.text
        used += answer.json()["usage"]["total_tokens"]
    waits.append(refused(complete(gw.url, "key-beta"), "tokens_per_minute"))
    # max_queued 1: one job waits (as if no slot were free), so the next is refused; others are not
    # affected
    redis.zadd(tenant_queued_key("delta"), {"waiting-job": int(time.time() * 1000) + 120_000})
    assert refused(complete(gw.url, "key-delta"), "max_queued") >= 1
    redis.delete(tenant_queued_key("delta"))
    assert complete(gw.url, "key-low").status_code == 200
    # the minute turns: both are admitted again
    assert all(1 <= w <= 60 for w in waits), waits
    time.sleep(max(waits) + 0.5)
    assert complete(gw.url, "key-alpha").status_code == 200
    assert complete(gw.url, "key-beta").status_code == 200
    # every refusal was counted in the tenant's usage (this hour and the last: the wait may cross one)
    usage = run(redis, usage_plan(None, 2))
    assert usage["alpha"]["rejected_requests_per_minute"] == 1
    assert usage["beta"]["rejected_tokens_per_minute"] == 1
    assert usage["delta"]["rejected_max_queued"] == 1


def test_two_gateways_never_admit_more_than_max_concurrent(redis: Redis, workers: Any,
                                                           gateways: Gateways) -> None:
    workers.start("w1", **FAKE, **SETTINGS, backend__step_delay=0.3)
    first, second = gateways.start(**SETTINGS), gateways.start(**SETTINGS)
    wait_until_healthy(first)
    wait_until_healthy(second)
    codes: list[int] = []

    def ask(url: str) -> None:
        codes.append(complete(url, "key-gamma", prompt="a b c d e f g h", max_tokens=8).status_code)

    threads = [threading.Thread(target=ask, args=(gw.url,)) for gw in [first, second] * 5]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(codes) == [200, 200] + [429] * 8, codes
    # the jobs ended, their places are free again
    assert complete(first.url, "key-gamma").status_code == 200
    assert redis.zcard("fleet:tenant:gamma:open") == 0


def test_a_tenant_sees_only_its_own_and_an_operator_sees_all(workers: Any, gateways: Gateways) -> None:
    workers.start("w1", **FAKE, **SETTINGS)
    gw = gateways.start(**SETTINGS)
    mine = batch_of(gw.url, jsonl(2), "key-alpha")
    file_id, bid = mine["input_file_id"], mine["id"]
    for path in (f"/v1/files/{file_id}", f"/v1/files/{file_id}/content", f"/v1/batches/{bid}",
                 f"/v1/files/file-out-{bid}"):
        assert httpx.get(gw.url + path, headers=auth("key-beta"), timeout=10).status_code == 404, path
    assert httpx.get(f"{gw.url}/v1/batches", headers=auth("key-beta"), timeout=10).json()["data"] == []
    assert httpx.get(f"{gw.url}/v1/batches/{bid}", headers=auth("key-alpha"), timeout=10).status_code == 200
    seen = httpx.get(f"{gw.url}/v1/batches", headers=auth("key-admin"), timeout=10).json()["data"]
    assert [b["id"] for b in seen] == [bid]
    assert httpx.get(f"{gw.url}/v1/batches/{bid}", headers=auth("key-admin"), timeout=10).status_code == 200
    # an operator reads a tenant's uploaded file and deletes it; then it is gone for its tenant too
    file_url = f"{gw.url}/v1/files/{file_id}"
    own = httpx.get(f"{file_url}/content", headers=auth("key-alpha"), timeout=10)
    admin = httpx.get(f"{file_url}/content", headers=auth("key-admin"), timeout=10)
    assert admin.status_code == 200 and admin.content == own.content and own.content
    assert httpx.get(file_url, headers=auth("key-admin"), timeout=10).json()["id"] == file_id
    assert httpx.delete(file_url, headers=auth("key-beta"), timeout=10).status_code == 404
    assert httpx.delete(file_url, headers=auth("key-admin"), timeout=10).json()["deleted"]
    assert httpx.get(file_url, headers=auth("key-alpha"), timeout=10).status_code == 404
    # operators' views: a tenant's key gets 403, an admin key the page's data
    assert httpx.get(f"{gw.url}/metrics", headers=auth("key-alpha"), timeout=10).status_code == 403
    assert httpx.get(f"{gw.url}/metrics", headers=auth("key-admin"), timeout=10).status_code == 200
    status = f"{gw.url}/dashboard/api/status"
    assert httpx.get(status, headers=auth("key-alpha"), timeout=10).status_code == 401
    assert httpx.get(status, headers=auth("key-admin"), timeout=10).status_code == 200
    # a job (and its stream) has no address a tenant can use: only the operators' dashboard
    # reads one, and it tells a tenant's key nothing, not even whether the id exists
    job_id = complete(gw.url, "key-alpha").json()["id"].removeprefix("cmpl-")
    job = f"{gw.url}/dashboard/api/job/{job_id}"
    unknown = f"{gw.url}/dashboard/api/job/{'f' * 32}"
    for key in ("key-alpha", "key-beta"):
        assert httpx.get(job, headers=auth(key), timeout=10).status_code == 401
        assert httpx.get(unknown, headers=auth(key), timeout=10).status_code == 401
    wait_for(lambda: httpx.get(job, headers=auth("key-admin"), timeout=10).status_code == 200, 10,
             "the operator reads the job's record")


def test_usage_counts_what_the_results_report(redis_url: str, redis: Redis, workers: Any,
                                              gateways: Gateways) -> None:
    workers.start("w1", **FAKE, **SETTINGS)
    gw = gateways.start(**SETTINGS)
    wait_until_healthy(gw)
    reported = {"prompt_tokens": 0, "completion_tokens": 0}
    for prompt in ("one", "one two", "one two three four"):
        answer = complete(gw.url, "key-gamma", prompt=prompt, max_tokens=4)
        assert answer.status_code == 200, answer.text
        for field in reported:
            reported[field] += answer.json()["usage"][field]
    # a plain RQ producer naming a tenant: counted as that tenant's
    rq_job = Queue("llm:default", connection=redis, serializer="json").enqueue(
        "dispatcher.jobs.generate", {"prompt": "via rq", "max_tokens": 2, "tenant": "batchbot"})
    wait_for(lambda: redis.hget(job_key(rq_job.id), "status") == b"finished", 30, "the RQ job to finish")
    usage = wait_for(lambda: (u := run(redis, usage_plan(None, 2))).get("batchbot") and u, 10, "usage")
    assert {f: usage["gamma"][f] for f in reported} == reported and usage["gamma"]["requests"] == 3
    assert usage["batchbot"]["requests"] == 1 and usage["batchbot"]["completion_tokens"] > 0
    # Prometheus (an operator's key): the same counts, by tenant
    text = httpx.get(f"{gw.url}/metrics", headers=auth("key-admin"), timeout=10).text
    families = {(s.name, s.labels.get("tenant"), s.labels.get("limit")): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}
    assert families[("llama_fleet_tenant_requests_total", "gamma", None)] == 3
    tokens = families[("llama_fleet_tenant_completion_tokens_total", "gamma", None)]
    assert tokens == reported["completion_tokens"]
    assert families[("llama_fleet_tenant_requests_total", "batchbot", None)] == 1
    # `fleet usage` reads the same counters: as JSON, and as a table
    cli = [sys.executable, "-m", "ecosystem.cli", "usage", "--since", "2h"]
    env = cli_env(redis_url)
    shown = json.loads(subprocess.run([*cli, "--json", "--tenant", "gamma"], env=env, cwd=ROOT, check=True,
                                      capture_output=True, text=True).stdout)
    assert shown == {"gamma": usage["gamma"]}
    table = subprocess.run(cli, env={**env, "COLUMNS": "160"}, cwd=ROOT, check=True, capture_output=True,
                           text=True).stdout
    assert "batchbot" in table and "gamma" in table


def test_max_priority_and_models_hold(redis: Redis, workers: Any, gateways: Gateways) -> None:
    workers.start("w1", **FAKE, **SETTINGS)
    gw = gateways.start(**SETTINGS)
    wait_until_healthy(gw)
    answer = complete(gw.url, "key-low", headers={"X-Fleet-Priority": "high"})
    assert answer.status_code == 200
    origin = redis.hget(job_key(answer.headers["X-Fleet-Job-Id"]), "origin")
    assert origin == b"llm:low:low"  # the tenant's own queue at its ceiling, not high
    other = complete(gw.url, "key-low", model="other")
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    assert "other" not in other.json()["error"]["message"].split("serves:")[1]
    assert complete(gw.url, "key-alpha", model="other").status_code == 200


def test_a_tenants_settings_refuse_what_does_not_belong(redis: Redis, gateways: Gateways) -> None:
    """A bad tenant name or a key listed twice stops `fleet serve` with a message that never
    shows a key."""
    import pytest

    twice = {"a": {"api_keys": ["dup-key"]}, "b": {"api_keys": ["dup-key"]}}
    for tenants, words in [({"bad name": {}}, "tenant name"), (twice, "listed twice")]:
        with pytest.raises(RuntimeError) as failed:
            gateways.start(gateway__tenants=tenants)
        assert words in str(failed.value) and "dup-key" not in str(failed.value)
    assert json.dumps(TENANTS)  # the settings above are plain JSON, as FLEET_GATEWAY__TENANTS takes


def test_the_dashboard_shows_each_tenants_usage(redis_url: str, workers: Any, gateways: Gateways,
                                                tmp_path: Path) -> None:
    """In headless Chromium: the gateway's dashboard lists the tenants and what they used."""
    from tests.test_observe_views import chromium

    workers.start("w1", **FAKE)
    gw = gateways.start()
    wait_until_healthy(gw)
    fleet = Fleet(redis_url)
    for tenant, n in (("team-red", 2), ("team-blue", 1)):
        for i in range(n):
            fleet.submit(prompt=f"hello {i}", max_tokens=2, tenant=tenant).result(timeout=30)
    out = chromium("--virtual-time-budget=4000", "--dump-dom", f"{gw.url}/dashboard/", profile=tmp_path / "p")
    rows = dict(re.findall(r'<tr data-tenant="([^"]+)"><td>[^<]*</td><td class="num">(\d+)</td>', out.stdout))
    assert rows == {"team-red": "2", "team-blue": "1"}, out.stdout[-3000:]
