"""End to end through real parts: redis-server, `fleet worker` processes on the real model, RQ."""

from __future__ import annotations

import subprocess

import pytest
from redis import Redis
from rq import Queue
from rq.serializers import JSONSerializer

from backends.contract.keys import JOB_FUNCTION
from dispatcher import Fleet
from tests.harness import ROOT

pytestmark = pytest.mark.model


def test_submit_stream_result(redis_url: str, workers) -> None:
    workers.start("w1", backend__slots=4)
    fleet = Fleet(redis_url)
    job = fleet.submit(prompt="Once upon a time", max_tokens=24, temperature=0.0)
    deltas = list(job.stream(timeout=60))
    res = job.result(timeout=10)
    assert "".join(deltas) == res["text"] and res["text"]
    assert res["finish_reason"] == "length"
    assert res["usage"]["completion_tokens"] == 24
    assert res["worker"] == "w1" and res["backend"] == "llama-cpp"
    t = res["timings"]
    assert t["queue_ms"] >= 0 and 0 < t["ttft_ms"] <= t["total_ms"]


def test_late_subscriber_gets_every_token(redis_url: str, workers) -> None:
    workers.start("w1", backend__slots=2)
    fleet = Fleet(redis_url)
    job = fleet.submit(prompt="The sea was calm and", max_tokens=20, temperature=0.0)
    res = job.result(timeout=60)
    assert "".join(fleet.job(job.id).stream(timeout=5)) == res["text"]


def test_concurrent_jobs_run_in_one_worker(redis_url: str, workers) -> None:
    workers.start("w1", backend__slots=8)
    fleet = Fleet(redis_url)
    jobs = [fleet.submit(prompt=f"Story {i}: once", max_tokens=16, temperature=0.7, seed=i) for i in range(8)]
    results = [j.result(timeout=120) for j in jobs]
    assert all(r["usage"]["completion_tokens"] == 16 or r["finish_reason"] == "stop" for r in results)
    # all 8 overlapped: each started before the first one finished
    r = Redis.from_url(redis_url)
    assert r.zcard("rq:finished:llm:default") == 8


def test_plain_rq_producer(redis_url: str, workers) -> None:
    workers.start("w1", backend__slots=2)
    r = Redis.from_url(redis_url)
    q = Queue("llm:default", connection=r, serializer=JSONSerializer)
    rq_job = q.enqueue(JOB_FUNCTION, {"prompt": "Hello", "max_tokens": 8, "temperature": 0.0})
    res = Fleet(redis_url).job(rq_job.id).result(timeout=60)
    assert res["usage"]["completion_tokens"] <= 8
    rq_job.refresh()
    assert rq_job.get_status() == "finished"
    assert rq_job.latest_result().return_value["text"] == res["text"]


def test_rq_info_lists_worker(redis_url: str, workers) -> None:
    workers.start("w-info", backend__slots=2)
    out = subprocess.run([str(ROOT / ".venv/bin/rq"), "info", "-u", redis_url, "--only-workers"],
                         capture_output=True, text=True, check=True).stdout
    assert "w-info" in out
