"""Token budgets (docs/tenants.md, "Budgets") on real processes: redis-server with an AOF, `fleet
serve`, fake-engine `fleet worker`s. A tenant at a hard budget gets 429 with the reset time on
every route that starts jobs, a soft budget only marks, a worker killed mid-job leaves the spend
equal to the results' usage (also after a Redis crash), and the periods reset on Redis's clock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis

from backends.contract.keys import spend_prefix
from backends.contract.queue.scripts import PRELUDE
from dispatcher import Fleet
from dispatcher.plans import run
from dispatcher.tenants import spend_plan, usage_plan, utc
from tests.gateway_harness import Gateways, wait_until_healthy
from tests.harness import ROOT, RedisServer, wait_for
from tests.observe_helpers import cli_env
from tests.reliability_checks import assert_exactly_one_final, fleet_workers, held, wait_streaming
from tests.test_hostile_batch import auth, jsonl, upload
from tests.test_tenants_gateway import FAKE

pytestmark = pytest.mark.timeout(240)

MONTH_TOKENS = 5
MONTH = {"tokens": MONTH_TOKENS, "period": "month"}
TENANTS = {
    "capped": {"api_keys": ["key-capped"], "budgets": [MONTH]},
    "soft": {"api_keys": ["key-soft"], "budgets": [{"tokens": 5, "period": "day", "hard": False}],
             "prices": {"prompt": 0.5, "completion": 2.0}},
    "daily": {"api_keys": ["key-daily"], "budgets": [{"tokens": 100, "period": "day"}]},
    "weekly": {"api_keys": ["key-weekly"], "budgets": [{"tokens": 100, "period": "week"}]},
    "rolling": {"api_keys": ["key-rolling"], "budgets": [{"tokens": 100, "period": "week", "rolling": True}]},
    "team": {"keys": {"ci": {"key": "key-ci", "budgets": [{"tokens": 5, "period": "day"}]},
                      "app": {"key": "key-app"}},
             "budgets": [{"tokens": 100_000, "period": "month"}]},
}
SETTINGS = {"gateway__tenants": TENANTS, "gateway__admin_keys": ["key-admin"]}
MESSAGES = [{"role": "user", "content": "one two three"}]
ROUTES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"model": "llm", "messages": MESSAGES, "max_tokens": 3}),
    "completions": ("/v1/completions", {"model": "llm", "prompt": "one two three", "max_tokens": 3}),
    "responses": ("/v1/responses", {"model": "llm", "input": "one two three", "max_output_tokens": 16}),
    "messages": ("/v1/messages", {"model": "llm", "messages": MESSAGES, "max_tokens": 3}),
    "ollama-chat": ("/api/chat", {"model": "llm", "messages": MESSAGES, "stream": False}),
    "ollama-generate": ("/api/generate", {"model": "llm", "prompt": "one two three", "stream": False}),
    "embeddings": ("/v1/embeddings", {"model": "llm", "input": "one two three"}),
    "ollama-embed": ("/api/embed", {"model": "llm", "input": "one two three"}),
}


@pytest.fixture
def aof_server(tmp_path: Path) -> Iterator[RedisServer]:
    # every write on disk before its reply: a crash (SIGKILL) loses nothing written
    with RedisServer.start(tmp_path / "redis", extra=["--appendonly", "yes", "--appendfsync", "always"]) as s:
        yield s


@pytest.fixture
def redis_url(aof_server: RedisServer) -> str:
    """The fixtures' processes (workers, gateways) on a Redis with an AOF."""
    return aof_server.url


def complete(url: str, key: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=auth(key), timeout=60,
                      json={"model": "llm", "prompt": "one two three", "max_tokens": 3})


def spent(redis: Redis, tenant: str, key: str | None = None) -> int:
    """The tenant's (or its named key's) tokens today and the 29 days before it."""
    _, spends = run(redis, spend_plan(tenant, [("month", True)], key))
    return spends[0].tokens


def next_month(now: int) -> int:
    today = datetime.fromtimestamp(now, UTC).date()
    first = date(today.year + today.month // 12, today.month % 12 + 1, 1)
    return int(datetime(first.year, first.month, 1, tzinfo=UTC).timestamp())


def budget_refusal(response: httpx.Response, now: int, resets_at: int) -> None:
    """A 429 naming the budget, its spend and its reset (in the message and Retry-After)."""
    assert response.status_code == 429, response.text
    assert "budget" in response.text and f" at {utc(resets_at)}" in response.text, response.text
    wait = int(response.headers["Retry-After"])
    assert resets_at - now - 5 <= wait <= resets_at - now, (wait, resets_at - now)


@pytest.mark.parametrize("route", [*ROUTES, "batches"])
def test_a_tenant_at_its_budget_gets_429_with_the_reset_time(route: str, redis: Redis, workers: Any,
                                                            gateways: Gateways) -> None:
    workers.start("w1", **FAKE, **SETTINGS)
    gw = gateways.start(**SETTINGS)
    wait_until_healthy(gw)
    while spent(redis, "capped") < MONTH_TOKENS:  # spend up to the budget: admitted till then
        answer = complete(gw.url, "key-capped")
        assert answer.status_code == 200, answer.text
    now = int(redis.time()[0])
    if route == "batches":
        file = upload(gw.url, jsonl(2), "key-capped")
        assert file.status_code == 200, file.text
        response = httpx.post(f"{gw.url}/v1/batches", headers=auth("key-capped"), timeout=60,
                              json={"input_file_id": file.json()["id"], "endpoint": "/v1/completions",
                                    "completion_window": "24h"})
    else:
        path, body = ROUTES[route]
        response = httpx.post(f"{gw.url}{path}", headers=auth("key-capped"), json=body, timeout=60)
    budget_refusal(response, now, next_month(now))
    assert f"{spent(redis, 'capped'):,} spent" in response.text
    assert "month budget of 5 tokens" in response.text
    # another tenant is not held back, and the refusal is counted
    assert complete(gw.url, "key-daily").status_code == 200
    assert run(redis, usage_plan("capped", 1))["capped"]["rejected_budget"] == 1


def test_a_soft_budget_marks_answers_and_serves_them(redis_url: str, redis: Redis, workers: Any,
                                                     gateways: Gateways) -> None:
    workers.start("w1", **FAKE, **SETTINGS)
    gw = gateways.start(**SETTINGS)
    wait_until_healthy(gw)
    first = complete(gw.url, "key-soft")
    assert first.status_code == 200 and "x-fleet-budget-exceeded" not in first.headers
    while spent(redis, "soft") < 5:
        assert complete(gw.url, "key-soft").status_code == 200
    for path, body in ROUTES.values():
        if "embed" in path:
            continue  # the fake engine does not embed
        past = httpx.post(f"{gw.url}{path}", headers=auth("key-soft"), json=body, timeout=60)
        assert past.status_code == 200, (path, past.text)
        assert past.headers["x-fleet-budget-exceeded"] == "day", (path, dict(past.headers))
        assert int(past.headers["x-fleet-budget-spent"]) >= 5 and past.headers["x-fleet-budget-limit"] == "5"
        tomorrow = (int(redis.time()[0]) // 86400 + 1) * 86400
        assert past.headers["x-fleet-budget-reset"] == utc(tomorrow)
    marked = len(ROUTES) - 2
    assert run(redis, usage_plan("soft", 1))["soft"]["over_budget"] == marked
    metrics = httpx.get(f"{gw.url}/metrics", headers=auth("key-admin"), timeout=30).text
    assert f'llama_fleet_tenant_over_budget_requests_total{{tenant="soft"}} {marked}.0' in metrics
    # `fleet usage --period day`: the spend against the budget, priced
    env = {**cli_env(redis_url),
           "FLEET_GATEWAY__TENANTS": json.dumps(TENANTS), "COLUMNS": "200"}
    cli = [sys.executable, "-m", "ecosystem.cli", "usage", "--period", "day"]
    shown = json.loads(subprocess.run([*cli, "--json", "--tenant", "soft"], env=env, cwd=ROOT, check=True,
                                      capture_output=True, text=True).stdout)
    tokens = spent(redis, "soft")
    (line,) = shown
    assert line["tokens"] == tokens == line["prompt_tokens"] + line["completion_tokens"]
    assert line["budget"] == {"tokens": 5, "hard": False} and line["period"] == "day"
    prompt, cached = line["prompt_tokens"], line["cached_tokens"]
    assert line["cost"] == pytest.approx(((prompt - cached) * 0.5 + line["completion_tokens"] * 2.0) / 1000)
    table = subprocess.run(cli, env=env, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    assert "soft" in table and "5 soft" in table and f"{tokens / 5:.0%}" in table, table


def test_a_named_key_has_its_own_budget_within_its_tenant(redis_url: str, redis: Redis, workers: Any,
                                                          gateways: Gateways) -> None:
    workers.start("w1", **FAKE, **SETTINGS)
    gw = gateways.start(**SETTINGS)
    wait_until_healthy(gw)
    while spent(redis, "team", "ci") < 5:
        assert complete(gw.url, "key-ci").status_code == 200
    assert complete(gw.url, "key-app").status_code == 200
    now = int(redis.time()[0])
    refusal = complete(gw.url, "key-ci")
    budget_refusal(refusal, now, (now // 86400 + 1) * 86400)
    assert "tenant 'team' key 'ci' reached its day budget of 5 tokens" in refusal.text, refusal.text
    before = spent(redis, "team", "ci")
    assert complete(gw.url, "key-app").status_code == 200  # the tenant's other key is not held back
    # a body naming another key (or tenant) changes nothing: the key that asks is whose spend it is
    spoof = httpx.post(f"{gw.url}/v1/completions", headers=auth("key-app"), timeout=60,
                       json={"model": "llm", "prompt": "x", "max_tokens": 2, "key_name": "ci",
                             "tenant": "soft"})
    assert spoof.status_code in (200, 400), spoof.text
    ci, app = spent(redis, "team", "ci"), spent(redis, "team", "app")
    assert ci == before and spent(redis, "soft") == 0
    assert app > 0 and spent(redis, "team") == ci + app
    env = {**cli_env(redis_url), "FLEET_GATEWAY__TENANTS": json.dumps(TENANTS)}
    shown = json.loads(subprocess.run([sys.executable, "-m", "ecosystem.cli", "usage", "--period", "day",
                                       "--json", "--tenant", "team"], env=env, cwd=ROOT, check=True,
                                      capture_output=True, text=True).stdout)
    assert [(line["tenant"], line["tokens"]) for line in shown] == [
        ("team", ci + app), ("team (key ci)", ci), ("team (key app)", app)]
    assert shown[1]["budget"] == {"tokens": 5, "hard": True}


def test_a_period_resets_at_its_start_on_redis_clock(redis: Redis, workers: Any, gateways: Gateways) -> None:
    """Yesterday's spend (by Redis's clock) at each budget: the calendar day has reset; the ISO
    week has only if today is a Monday; the rolling week has not (it resets as yesterday leaves
    it, at midnight)."""
    workers.start("w1", **FAKE, **SETTINGS)
    gw = gateways.start(**SETTINGS)
    wait_until_healthy(gw)
    now = int(redis.time()[0])
    yesterday = now // 86400 - 1
    for tenant in ("daily", "weekly", "rolling"):
        key = f"{spend_prefix(tenant)}:{yesterday}"
        redis.hset(key, mapping={"prompt_tokens": 60, "completion_tokens": 40})
        redis.expire(key, 86400)
    assert complete(gw.url, "key-daily").status_code == 200
    weekly = complete(gw.url, "key-weekly")
    monday = datetime.fromtimestamp(now, UTC).weekday() == 0
    if monday:
        assert weekly.status_code == 200, weekly.text
    else:
        this_monday = (now // 86400 - datetime.fromtimestamp(now, UTC).weekday()) * 86400
        budget_refusal(weekly, now, this_monday + 7 * 86400)
    budget_refusal(complete(gw.url, "key-rolling"), now, (now // 86400 + 1) * 86400)


def test_kill9_mid_job_and_a_redis_crash_leave_spend_equal_to_results_usage(
        aof_server: RedisServer, redis: Redis, tmp_path: Path) -> None:
    fleet = Fleet(aof_server.url)
    words = " ".join(f"n{i}" for i in range(12))
    paced = {"backend__type": "fake", "backend__slots": 4, "backend__step_delay": 0.1}
    with fleet_workers(aof_server.url, tmp_path / "logs") as workers:
        workers.start("w1", **paced)
        w2 = workers.start("w2", **paced)
        jobs = [fleet.submit(prompt=f"Note {i}: {words}", max_tokens=24, tenant="spender") for i in range(16)]
        wait_streaming(redis, "w2", at_least=2)
        os.kill(w2.process.pid, signal.SIGKILL)
        w2.process.wait(10)
        victims = held(redis, "w2")
        assert victims, "w2 held nothing when it was killed"
        results = {job.id: job.result(timeout=180) for job in jobs}
    assert_exactly_one_final(redis, [j.id for j in jobs])
    assert any(results[v]["attempt"] == 2 for v in victims), [results[v] for v in victims]
    usage = [r["usage"] for r in results.values()]
    expected = sum(u["prompt_tokens"] + u["completion_tokens"] for u in usage)
    assert expected > 0 and spent(redis, "spender") == expected
    aof_server.restart(signal.SIGKILL)  # a crash: the AOF brings the counts back
    wait_for(lambda: redis.ping(), 10, "redis back")
    assert spent(redis, "spender") == expected
    days = [k for k in redis.scan_iter(f"{spend_prefix('spender')}:*")]
    assert days and all(0 < redis.ttl(k) <= 33 * 86400 for k in days)


def test_budget_periods_follow_the_calendar(redis: Redis) -> None:
    """periods.lua against Python's calendar, for days across centuries and every month's edges."""
    periods = (Path(__file__).parents[1] / "backends/contract/queue/periods.lua").read_text()
    probe = PRELUDE + "\n" + periods + """
local first, resets = period_window(tonumber(ARGV[1]), ARGV[2], ARGV[3] == '1')
return {first, resets}"""
    epoch = date(1970, 1, 1)
    days = [date(y, m, d) for y in (1999, 2000, 2024, 2026, 2100) for m in range(1, 13) for d in (1, 28)]
    days += [date(y, 12, 31) for y in (1999, 2026)] + [date(2024, 2, 29), date(2026, 11, 30)]
    for day in days:
        today = (day - epoch).days
        nxt = date(day.year + day.month // 12, day.month % 12 + 1, 1)
        monday = day - timedelta(days=day.weekday())
        expected = {("month", "0"): [(day.replace(day=1) - epoch).days, (nxt - epoch).days * 86400],
                    ("week", "0"): [(monday - epoch).days, ((monday - epoch).days + 7) * 86400],
                    ("day", "0"): [today, (today + 1) * 86400],
                    ("month", "1"): [today - 29, (today + 1) * 86400],
                    ("week", "1"): [today - 6, (today + 1) * 86400]}
        for (period, rolling), want in expected.items():
            got = redis.eval(probe, 0, today, period, rolling)
            assert [int(v) for v in got] == want, (day, period, rolling, got, want)
