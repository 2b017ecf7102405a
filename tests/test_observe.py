"""Observability against a live fleet: real redis-server, 2 `fleet worker` processes;
`fleet status` / `jobs` / `job`, the Prometheus exporter (on the real model: the status names its
engine), a killed worker (the fake engine, paced: what is watched is the worker's death)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from redis import Redis

from backends.contract.keys import worker_key
from dispatcher import Fleet
from dispatcher.observe import snapshot
from ecosystem.local.processes import free_port
from tests.harness import ROOT, wait_for
from tests.observe_helpers import cli_env, collect, fleet, fleet_json, scrape, value


@pytest.mark.model
@pytest.mark.timeout(600)
def test_status_jobs_and_metrics_follow_a_live_fleet(redis_url: str, redis: Redis, workers) -> None:
    workers.start("w1", backend__slots=4)
    workers.start("w2", backend__slots=4)
    port = free_port()
    exporter = subprocess.Popen([sys.executable, "-m", "ecosystem.cli", "metrics", "--port", str(port)],
                                env=cli_env(redis_url), cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        before = wait_for(lambda: _try_scrape(port), 30, "the exporter to answer")
        assert value(before, "llama_fleet_worker_up") == 2
        client = Fleet(redis_url)
        jobs = [client.submit(prompt=f"Tell story number {i} about a fox.", max_tokens=48, temperature=0.0)
                for i in range(8)]

        def both_busy() -> dict | None:
            snap = fleet_json(redis_url, "status")
            held = {w["name"]: w["inflight"] for w in snap["workers"]}
            return snap if len(held) == 2 and all(held.values()) else None

        snap = wait_for(both_busy, 120, "both workers to hold jobs", interval=0.2)
        assert {w["name"] for w in snap["workers"]} == {"w1", "w2"}
        for w in snap["workers"]:
            assert w["up"] and w["slots"] == 4 and w["backend"] == "llama-cpp"
            assert w["backend_health"] == "ok" and w["rss_mb"] > 0 and "cpu_pct" in w
            assert w["jobs"] and all(0 <= j["tokens"] <= 48 and j["max_tokens"] == 48 for j in w["jobs"])
        assert snap["totals"]["busy"] >= 2 and snap["totals"]["slots"] == 8
        table = fleet(redis_url, "status").stdout
        assert "w1" in table and "w2" in table and "busy" in table and "running jobs" in table
        assert max(len(line) for line in table.splitlines()) <= 80
        during = scrape(port)
        assert value(during, "llama_fleet_slots_busy") >= 2 and value(during, "llama_fleet_slots") == 8
        assert value(during, "llama_fleet_worker_up", worker="w1") == 1

        results = [j.result(timeout=300) for j in jobs]
        after = scrape(port)
    finally:
        exporter.terminate()
        exporter.wait(10)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    generated = sum(r["usage"]["completion_tokens"] for r in results)
    prompt = sum(r["usage"]["prompt_tokens"] for r in results)
    assert delta("llama_fleet_jobs_total", outcome="finished") == 8
    assert delta("llama_fleet_jobs_total", outcome="failed") == 0
    assert delta("llama_fleet_tokens_generated_total") == generated
    assert delta("llama_fleet_prompt_tokens_total") == prompt
    assert delta("llama_fleet_worker_tokens_generated_total") == generated
    for hist in ("ttft", "queue_wait", "job_duration"):
        assert delta(f"llama_fleet_{hist}_seconds_count") == 8, hist
    ttft_sum = sum(r["timings"]["ttft_ms"] for r in results) / 1000
    assert abs(delta("llama_fleet_ttft_seconds_sum") - ttft_sum) < 0.05

    listed = {r["id"]: r for r in fleet_json(redis_url, "jobs", "--limit", "20")}
    for job, res in zip(jobs, results, strict=True):
        record = listed[job.id]
        assert record["state"] == "finished" and record["end"]["worker"] == res["worker"]
        assert record["params"]["max_tokens"] == 48 and "fox" in record["params"]["prompt"]
        assert record["end"]["timings"]["ttft_ms"] == res["timings"]["ttft_ms"]
    shown = fleet(redis_url, "job", jobs[0].id).stdout
    assert results[0]["worker"] in shown and "ttft" in shown and "story number 0" in shown
    assert fleet_json(redis_url, "jobs", "--failed") == []


def _try_scrape(port: int):  # type: ignore[no-untyped-def]
    try:
        return scrape(port)
    except Exception:
        return None


@pytest.mark.timeout(600)  # a shared 2-core box: the rerun of a killed job may be slow
def test_a_killed_worker_leaves_status_within_its_ttl_and_its_job_says_why(redis_url: str, redis: Redis,
                                                                           workers) -> None:
    paced = {"backend__type": "fake", "backend__slots": 2, "backend__step_delay": 0.05}
    started = (workers.start("w-a", **paced), workers.start("w-b", **paced))
    procs = {w.name: w for w in started}
    story = " ".join(f"sea{i}" for i in range(120))  # the fake engine says it back: 120 steps, ~6 s
    job = Fleet(redis_url).submit(prompt=f"Write a long story about the sea. {story}", max_tokens=120,
                                  temperature=0.0)
    next(iter(job.stream(timeout=120, detach=True)))  # only a peek: leaving it must not cancel
    holder = fleet_json(redis_url, "job", job.id)["attempts"][0]["worker"]
    (other,) = set(procs) - {holder}
    # the status key's TTL is 3 heartbeats (1 s each) from the last beat, and only the worker sets
    # it: read just before the kill, it bounds the key's life after the kill by Redis's own clock
    # (<= 3 s), not by how soon this process notices on a loaded box
    ttl_ms = redis.pttl(worker_key(holder))
    procs[holder].stop(signal.SIGKILL)
    assert 0 < ttl_ms <= 3 * 1000, ttl_ms
    wait_for(lambda: not redis.exists(worker_key(holder)), 10, f"{holder}'s status key to expire",
             interval=0.1)
    assert holder not in {w["name"] for w in snapshot.workers(redis)}
    assert [w["name"] for w in fleet_json(redis_url, "status")["workers"]] == [other]

    res = job.result(timeout=300)
    assert res["worker"] == other and res["attempt"] == 2, res
    record = fleet_json(redis_url, "job", job.id)
    first, second = record["attempts"]
    assert first["worker"] == holder and f"worker {holder} died" in first["lost"]["reason"]
    assert first["lost"]["kind"] == "worker_died" and second["worker"] == other and "lost" not in second
    assert record["state"] == "finished" and record["end"]["attempt"] == 2
    shown = fleet(redis_url, "job", job.id[:12]).stdout  # the short id the tables print
    assert "died" in shown and holder in shown and other in shown
    metrics = collect(redis)
    assert value(metrics, "llama_fleet_job_restarts_total", reason="worker_died") == 1
    assert value(metrics, "llama_fleet_jobs_reaped_total") == 1
    assert value(metrics, "llama_fleet_worker_up", worker=holder) == 0  # reaped: gone from the set
    assert value(metrics, "llama_fleet_worker_up", worker=other) == 1
