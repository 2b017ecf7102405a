"""Issue 2 behaviours through real parts: priorities, cancel, bad input, SIGTERM, CLI."""

from __future__ import annotations

import json
import pickle
import signal
import subprocess
import sys
import zlib

import pytest
from redis import Redis
from rq import Queue
from rq.serializers import JSONSerializer

from backends.contract.keys import JOB_FUNCTION, queue_key
from dispatcher import Fleet, JobFailed
from tests.harness import ROOT, wait_for

LONG = 150  # tokens: long enough to still be running when we act on it


def fleet_cli(*args: str, env_url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "FLEET_CONFIG": str(ROOT / "worker-config.json")}
    if env_url:
        env["FLEET_REDIS_URL"] = env_url
    return subprocess.run([sys.executable, "-m", "ecosystem.cli", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


@pytest.mark.model
def test_priorities_high_before_default_before_low(redis_url: str, workers) -> None:
    fleet = Fleet(redis_url)
    # queue everything before any worker exists, lowest priority first
    low = [fleet.submit(prompt=f"low {i}", max_tokens=2, priority="low") for i in range(3)]
    default = [fleet.submit(prompt=f"default {i}", max_tokens=2) for i in range(3)]
    high = [fleet.submit(prompt=f"high {i}", max_tokens=2, priority="high") for i in range(3)]
    workers.start("w1", backend__slots=1)
    order = sorted(low + default + high, key=lambda j: j.result(timeout=120)["timings"]["queue_ms"])
    names = ["high"] * 3 + ["default"] * 3 + ["low"] * 3
    by_job = {j.id: n for group, n in ((high, "high"), (default, "default"), (low, "low")) for j in group}
    assert [by_job[j.id] for j in order] == names


def test_cancel_queued_job(redis_url: str) -> None:
    fleet = Fleet(redis_url)
    job = fleet.submit(prompt="never runs", max_tokens=8)
    assert job.cancel() == "cancelled"
    assert Redis.from_url(redis_url).llen(queue_key("llm:default")) == 0
    res = job.result(timeout=5)
    assert res["finish_reason"] == "cancelled" and res["text"] == ""


@pytest.mark.model
def test_cancel_running_job_keeps_partial_text(redis_url: str, workers) -> None:
    workers.start("w1", backend__slots=2)
    fleet = Fleet(redis_url)
    job = fleet.submit(prompt="Tell me a very long story:", max_tokens=LONG, temperature=0.0)
    stream = job.stream(timeout=60)
    next(stream)  # it is running
    assert job.cancel() == "cancelling"
    res = job.result(timeout=30)
    assert res["finish_reason"] == "cancelled"
    assert 0 < res["usage"]["completion_tokens"] < LONG
    # the worker serves the next job
    assert fleet.submit(prompt="Hi", max_tokens=3).result(timeout=60)["usage"]["completion_tokens"] <= 3


BAD_REQUESTS = [
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "   "}, "prompt is empty"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**7}, "max_tokens"),
    ({"prompt": "x", "colour": "red"}, "colour"),
    ({"max_tokens": 4}, "exactly one of 'prompt' or 'messages'"),
]


@pytest.mark.parametrize(("payload", "reason"), BAD_REQUESTS)
def test_producer_validates_before_redis(redis_url: str, payload: dict, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        Fleet(redis_url).submit(**payload)
    assert Redis.from_url(redis_url).llen(queue_key("llm:default")) == 0


def push_raw(r: Redis, job_id: str, data: bytes) -> None:
    """A job hash written by hand, the way a buggy or hostile producer could."""
    r.hset(f"rq:job:{job_id}", mapping={"data": data, "origin": "llm:default", "status": "queued",
                                         "created_at": "2026-01-01T00:00:00.000000Z",
                                         "enqueued_at": "2026-01-01T00:00:00.000000Z"})
    r.rpush(queue_key("llm:default"), job_id)


@pytest.mark.model
def test_bad_jobs_fail_alone_and_worker_keeps_serving(redis_url: str, workers) -> None:
    r = Redis.from_url(redis_url)
    q = Queue("llm:default", connection=r, serializer=JSONSerializer)
    too_long = " ".join(f"w{i}" for i in range(3000))
    cases = {
        "bad field": q.enqueue(JOB_FUNCTION, {"prompt": "x", "max_tokens": -1}).id,
        "empty prompt": q.enqueue(JOB_FUNCTION, {"prompt": ""}).id,
        "too long": q.enqueue(JOB_FUNCTION, {"prompt": too_long, "max_tokens": 4}).id,
        "foreign function": q.enqueue("os.system", "echo pwned").id,
    }
    push_raw(r, "pickled", zlib.compress(pickle.dumps(("os.system", None, ("echo pwned",), {}))))
    push_raw(r, "not-json", zlib.compress(b"{not json"))
    cases |= {"pickled": "pickled", "not json": "not-json"}
    good = Fleet(redis_url).submit(prompt="Still serving?", max_tokens=4)
    w = workers.start("w1", backend__slots=4)
    expected = {"bad field": "max_tokens", "empty prompt": "prompt is empty",
                "too long": "the context holds",
                "foreign function": "refused: job names function 'os.system'",
                "pickled": "not a JSON job", "not json": "not a JSON job"}
    fleet = Fleet(redis_url)
    for case, job_id in cases.items():
        with pytest.raises(JobFailed, match=expected[case]):
            fleet.job(job_id).result(timeout=60)
        assert fleet.job(job_id).status() == "failed", case
    assert good.result(timeout=60)["usage"]["completion_tokens"] <= 4
    assert w.alive()


@pytest.mark.model
def test_sigterm_with_job_in_flight_loses_nothing(redis_url: str, workers) -> None:
    w = workers.start("w1", backend__slots=2, drain_grace=0)
    fleet = Fleet(redis_url)
    job = fleet.submit(prompt="A long tale:", max_tokens=LONG, temperature=0.0)
    next(job.stream(timeout=60, detach=True))  # only a peek: leaving it must not cancel
    assert w.stop(signal.SIGTERM) == 0  # grace 0: requeued at once, process exits cleanly
    r = Redis.from_url(redis_url)
    assert job.id.encode() in r.lrange(queue_key("llm:default"), 0, -1)
    workers.start("w2", backend__slots=2)
    res = job.result(timeout=120)
    assert res["worker"] == "w2" and res["attempt"] == 2


@pytest.mark.model
def test_status_json_fields(redis_url: str, workers) -> None:
    workers.start("w-status", backend__slots=3)
    Fleet(redis_url).submit(prompt="Count:", max_tokens=4).result(timeout=60)

    def snapshot_after_next_beat() -> dict | None:  # the status hash refreshes every second
        out = fleet_cli("status", "--json", env_url=redis_url)
        assert out.returncode == 0, out.stderr
        snap = json.loads(out.stdout)
        return snap if snap["workers"] and snap["workers"][0]["tokens"] >= 4 else None

    snap = wait_for(snapshot_after_next_beat, 30, "the worker's status to count the tokens")
    (w,) = snap["workers"]
    for field in ("name", "host", "pid", "cpus", "backend", "state", "inflight", "tokens", "tok_s", "rss_mb"):
        assert field in w, field
    assert w["name"] == "w-status" and w["slots"] == 3 and w["tokens"] >= 4
    assert {q["priority"] for q in snap["queues"]} == {"high", "default", "low"}
    assert all({"depth", "started", "failed"} <= set(q) for q in snap["queues"])


@pytest.mark.model
def test_unreachable_redis_is_one_line() -> None:
    for args in (["status"], ["submit", "hi"], ["worker"]):
        out = fleet_cli(*args, env_url="redis://:hunter2@127.0.0.1:1/0")
        assert out.returncode == 1
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "cannot reach Redis at redis://:***@127.0.0.1:1/0" in lines[0], out.stderr
        assert "hunter2" not in out.stderr


def test_bad_config_names_the_key(tmp_path) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"backend": {"slotz": 4}}))
    out = fleet_cli("status", "--config", str(cfg))
    assert out.returncode == 1 and "backend.slotz" in out.stderr
