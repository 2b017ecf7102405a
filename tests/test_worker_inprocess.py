"""The worker loop in this process, in burst mode (`run_until_idle`), on the fake engine against a
real redis-server: cancel, job timeout, requeue on drain and on an engine failure, buffering
through a Redis outage, and ownership fencing. No model and no subprocess, so each runs in about
a second; tests/test_fleet_jobs.py, test_recovery.py and test_chaos.py keep what needs real
processes (signals, kill -9, the model)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from rq import Queue
from rq.serializers import JSONSerializer

from backends.contract.keys import inflight_key, queue_key
from dispatcher import Fleet, JobFailed
from tests.harness import RedisServer, wait_for
from tests.lossy import long_prompt, run_until
from tests.reliability_checks import assert_exactly_one_final, final_entries, stream_events
from worker.inprocess import fake_worker
from worker.liveness.reaper import Reaper
from worker.serving import loop

pytestmark = pytest.mark.timeout(120)
QUEUE = "llm:default"
PACED = {"step_delay": 0.005}  # fake engine: 200 tokens/s per job, so a job is caught mid-run


def test_burst_serves_every_queued_job_then_returns_what_ended(redis_url: str, redis: Redis) -> None:
    fleet = Fleet(redis_url)
    jobs = [fleet.submit(prompt=f"job number {i}", max_tokens=8) for i in range(6)]
    bad = Queue(QUEUE, connection=redis, serializer=JSONSerializer).enqueue("os.system", "true")
    summary = fake_worker(redis_url, "b1").run_until_idle(timeout=30)
    assert summary.idle and summary.ended == {"finished": 6, "failed": 1} and summary.total == 7
    assert [job.result(timeout=1)["text"] for job in jobs] == [f"job number {i}" for i in range(6)]
    assert "fleet workers run only" in (final_entries(redis, bad.id)[0].data or {})["error"]
    assert not redis.llen(queue_key(QUEUE)) and not redis.llen(inflight_key("b1"))
    assert_exactly_one_final(redis, [j.id for j in jobs] + [bad.id])


def test_burst_on_an_empty_pool_returns_at_once(redis_url: str) -> None:
    summary = fake_worker(redis_url, "b2").run_until_idle(timeout=30)
    assert summary.idle and summary.ended == {} and summary.seconds < 5


def test_cancel_of_a_queued_job_never_reaches_the_engine(redis_url: str, redis: Redis) -> None:
    fleet = Fleet(redis_url)
    cancelled = fleet.submit(prompt="never runs", max_tokens=8)
    kept = fleet.submit(prompt="runs", max_tokens=8)
    assert cancelled.cancel() == "cancelled"
    fw = fake_worker(redis_url, "c1")
    assert fw.run_until_idle(timeout=30).ended == {"finished": 1}
    assert cancelled.id not in fw.backend.admitted  # type: ignore[attr-defined]
    res = cancelled.result(timeout=1)
    assert res["finish_reason"] == "cancelled" and res["text"] == ""
    assert kept.result(timeout=1)["text"] == "runs"
    assert len(final_entries(redis, cancelled.id)) == 1  # the producer's (no RQ result: it never ran)
    assert_exactly_one_final(redis, [kept.id])


def test_cancel_of_a_running_job_keeps_its_partial_text(redis_url: str, redis: Redis) -> None:
    job = Fleet(redis_url).submit(prompt=long_prompt(2000), max_tokens=2000)
    fw = fake_worker(redis_url, "c2", backend=PACED)
    run_until([fw], lambda: job.id in fw.inflight and fw.inflight[job.id].sent > 0, what="streaming")
    assert job.cancel() == "cancelling"
    assert fw.run_until_idle(timeout=30).ended == {"cancelled": 1}
    res = job.result(timeout=1)
    assert res["finish_reason"] == "cancelled"
    assert 0 < res["usage"]["completion_tokens"] < 2000
    assert long_prompt(2000).startswith(res["text"])
    assert_exactly_one_final(redis, [job.id])


@pytest.mark.parametrize("interval", [0.0, 0.1])
def test_running_text_is_written_every_stream_interval_first_token_and_ending_at_once(
        redis_url: str, redis: Redis, interval: float) -> None:
    job = Fleet(redis_url).submit(prompt=long_prompt(80), max_tokens=80)
    fw = fake_worker(redis_url, f"si{int(interval * 1000)}", backend=PACED, stream_interval=interval)
    writes: list[int] = []  # the deltas of each write of the job's text
    queue_text = fw.writes.queue_text

    def counted(jobs: Any, pipe: Any) -> list[int]:
        counts = queue_text(jobs, pipe)
        writes.extend(n for j, n in zip(jobs, counts, strict=True) if j.id == job.id and n)
        return counts

    fw.writes.queue_text = counted  # type: ignore[method-assign]
    started = time.monotonic()
    assert fw.run_until_idle(timeout=30).ended == {"finished": 1}
    seconds = time.monotonic() - started
    assert writes[0] == 1  # the first token went out on its own, at once
    if interval:  # then one write an interval (0.4 s of 5 ms steps: ~5 writes)
        assert 3 <= len(writes) <= 2 + seconds / interval, (writes, seconds)
    else:  # every 5 ms step wrote its token
        assert writes == [1] * len(writes) and len(writes) >= 60, writes
    assert job.result(timeout=1)["text"] == long_prompt(80)  # every token, in order, then the end


@pytest.mark.alone  # its bound (0.5 s against the 1 s interval, the most it may be) needs a quiet box
def test_a_cancel_is_seen_at_once_however_long_the_stream_interval(redis_url: str, redis: Redis) -> None:
    job = Fleet(redis_url).submit(prompt=long_prompt(2000), max_tokens=2000)
    fw = fake_worker(redis_url, "si-cancel", backend=PACED, stream_interval=1.0)
    run_until([fw], lambda: job.id in fw.inflight and fw.inflight[job.id].sent > 0, what="streaming")
    assert job.cancel() == "cancelling"
    started = time.monotonic()
    assert fw.run_until_idle(timeout=30).ended == {"cancelled": 1}
    assert time.monotonic() - started < 0.5  # the flags are read every 50 ms, not every write
    assert long_prompt(2000).startswith(job.result(timeout=1)["text"])


def test_a_job_past_its_timeout_fails_and_the_worker_serves_on(redis_url: str, redis: Redis) -> None:
    fleet = Fleet(redis_url)
    slow = fleet.submit(prompt=long_prompt(2000), max_tokens=2000, job_timeout=1)
    fw = fake_worker(redis_url, "t1", backend=PACED)
    started = time.monotonic()
    assert fw.run_until_idle(timeout=30).ended == {"failed": 1}
    assert time.monotonic() - started < 5
    with pytest.raises(JobFailed) as failed:
        slow.result(timeout=1)
    assert "timed out: ran longer than 1s" in failed.value.error
    after = fleet.submit(prompt="still serving", max_tokens=4)
    assert fw.run_until_idle(timeout=30).ended == {"finished": 1}
    assert after.result(timeout=1)["worker"] == "t1"


def test_a_drain_hands_the_job_back_and_another_worker_finishes_it(redis_url: str, redis: Redis) -> None:
    """Drain grace 0: the job goes back to the front of its queue (not counted against
    max_attempts); the next worker runs it whole as attempt 2 and readers get that text only."""
    job = Fleet(redis_url).submit(prompt=long_prompt(300), max_tokens=300)
    draining = fake_worker(redis_url, "d1", backend=PACED, drain_grace=0, max_attempts=1)
    run_until([draining], lambda: job.id in draining.inflight and draining.inflight[job.id].sent > 0,
              what="streaming")
    draining.stop()
    draining.run()  # drains: nothing finishes within 0 s, so the job is handed back
    assert redis.lrange(queue_key(QUEUE), 0, -1) == [job.id.encode()]
    assert draining.outcomes == {"requeued": 1}
    assert fake_worker(redis_url, "d2").run_until_idle(timeout=30).ended == {"finished": 1}
    res = job.result(timeout=1)
    assert res["attempt"] == 2 and res["text"] == long_prompt(300) and res["worker"] == "d2"
    assert "".join(job.stream(timeout=1)) == long_prompt(300)
    assert_exactly_one_final(redis, [job.id])


def test_an_engine_failure_retries_then_gives_up_after_max_attempts(redis_url: str, redis: Redis) -> None:
    job = Fleet(redis_url).submit(prompt=long_prompt(50), max_tokens=50)
    summary = fake_worker(redis_url, "e1", fail_after=3, max_attempts=2).run_until_idle(timeout=30)
    assert summary.ended == {"requeued": 1, "failed": 1}
    with pytest.raises(JobFailed) as failed:
        job.result(timeout=1)
    assert "gave up after 2 attempts" in failed.value.error
    assert_exactly_one_final(redis, [job.id])


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, to stop and restart (AOF: the data survives)."""
    with RedisServer.start(tmp_path / "redis", extra=["--appendonly", "yes"]) as server:
        yield server


def _outage(server: RedisServer, workers: list[loop.FleetWorker], seconds: float) -> None:
    """Stop Redis, keep turning the loops for `seconds`, start Redis again."""
    server.stop()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for fw in workers:
            fw.run_once()
    server.restart()


def test_generation_goes_on_through_a_redis_outage(own_redis: RedisServer) -> None:
    redis = own_redis.client()
    fleet = Fleet(own_redis.url)
    jobs = [fleet.submit(prompt=long_prompt(400), max_tokens=400) for _ in range(2)]
    fw = fake_worker(own_redis.url, "o1", backend=PACED)
    run_until([fw], lambda: all(j.id in fw.inflight and fw.inflight[j.id].sent > 0 for j in jobs),
              what="both streaming")
    tokens_before = sum(fw.inflight[j.id].completion_tokens for j in jobs)
    _outage(own_redis, [fw], 1.0)
    assert not fw.link.up or fw.link.outages >= 1
    assert sum(fw.inflight[j.id].completion_tokens for j in jobs if j.id in fw.inflight) > tokens_before
    assert fw.run_until_idle(timeout=60).ended == {"finished": 2}
    for job in jobs:
        res = job.result(timeout=5)
        assert res["attempt"] == 1 and res["text"] == long_prompt(400)  # in its first attempt
        assert "".join(job.stream(timeout=5)) == res["text"]  # buffered deltas written in order
    assert_exactly_one_final(redis, [j.id for j in jobs])


def test_an_ending_waiting_out_an_outage_does_not_spin_the_loop(own_redis: RedisServer) -> None:
    """A job that finished while Redis is away waits for it without busy-looping: a spinning
    loop starves the Redis servers and Sentinels that are failing over on the same host."""
    fleet = Fleet(own_redis.url)
    job = fleet.submit(prompt=long_prompt(40), max_tokens=40)
    fw = fake_worker(own_redis.url, "o3", backend=PACED)
    run_until([fw], lambda: job.id in fw.inflight, what="the job running")
    steps = 0
    engine_step = fw.backend.step

    def counted(timeout: float) -> list[Any]:
        nonlocal steps
        steps += 1
        return engine_step(timeout)

    fw.backend.step = counted  # type: ignore[method-assign]
    _outage(own_redis, [fw], 1.5)
    assert fw.inflight[job.id].ending is not None, "the job should have finished during the outage"
    # ~40 steps generating and ~20 at 50 ms each waiting; a spin makes tens of thousands
    assert steps < 400, f"{steps} loop steps in a 1.5 s outage: the loop spins"
    fw.backend.step = engine_step  # type: ignore[method-assign]
    assert fw.run_until_idle(timeout=30).ended == {"finished": 1}
    assert job.result(timeout=5)["text"] == long_prompt(40)


def test_an_outage_longer_than_the_buffer_hands_jobs_back(own_redis: RedisServer,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop, "OUTAGE_BUFFER_ENTRIES", 50)
    redis = own_redis.client()
    fleet = Fleet(own_redis.url)
    jobs = [fleet.submit(prompt=long_prompt(400), max_tokens=400) for _ in range(3)]
    fw = fake_worker(own_redis.url, "o2", backend=PACED)
    run_until([fw], lambda: len(fw.inflight) == 3, what="three running")
    _outage(own_redis, [fw], 1.0)
    summary = fw.run_until_idle(timeout=60)
    assert summary.ended["finished"] == 3 and summary.ended.get("requeued", 0) >= 1, summary
    results = [job.result(timeout=5) for job in jobs]
    assert all(r["text"] == long_prompt(400) for r in results)
    assert any(r["attempt"] > 1 for r in results)
    assert_exactly_one_final(redis, [j.id for j in jobs])


def test_a_job_taken_over_gets_no_write_from_its_old_owner(redis_url: str, redis: Redis) -> None:
    """The reaper hands the job of a worker it thinks dead (no status key) to another worker;
    the old owner keeps generating, but none of its text and no ending of its lands."""
    job = Fleet(redis_url).submit(prompt=long_prompt(300), max_tokens=300)
    old = fake_worker(redis_url, "f1", backend=PACED)
    run_until([old], lambda: job.id in old.inflight and old.inflight[job.id].sent > 0, what="streaming")
    assert Reaper(redis, "reaper", max_attempts=3, result_ttl=600).reap_worker("f1") == 1
    new = fake_worker(redis_url, "f2", backend=PACED)
    run_until([new], lambda: job.id in new.inflight, what="the new owner started")
    old_entries = [e for e in stream_events(redis, job.id) if e.attempt == 1]
    summary = old.run_until_idle(timeout=30)  # the old owner's copy runs on until it notices
    assert "finished" not in summary.ended
    assert [e for e in stream_events(redis, job.id) if e.attempt == 1] == old_entries
    assert new.run_until_idle(timeout=30).ended == {"finished": 1}
    res = job.result(timeout=1)
    assert res["worker"] == "f2" and res["attempt"] == 2 and res["text"] == long_prompt(300)
    assert_exactly_one_final(redis, [job.id])


def test_fleet_worker_burst_cli_exits_when_idle_and_prints_what_ended(redis_url: str, tmp_path: Path) -> None:
    """`fleet worker --burst` as a process: serves what is queued, exits 0, prints the summary."""
    import json
    import subprocess
    import sys

    from ecosystem.local.processes import worker_env

    fleet = Fleet(redis_url)
    jobs = [fleet.submit(prompt=f"burst {i}", max_tokens=4) for i in range(3)]
    done = subprocess.run([sys.executable, "-m", "ecosystem.cli", "worker", "--burst"],
                          env=worker_env(redis_url, "cli-burst", backend__type="fake"),
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["idle"] is True and summary["ended"] == {"finished": 3}, summary
    assert [job.result(timeout=1)["text"] for job in jobs] == [f"burst {i}" for i in range(3)]


def test_a_stop_signal_cuts_the_idle_wait_short(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM while the worker blocks on its wake list stops it at once, not when the wait ends
    (the wait is made 30 s long here, so a worker that waits it out fails the test)."""
    monkeypatch.setattr(loop, "IDLE_WAIT", 30.0)
    fw = fake_worker(redis_url, "sig1")
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    fw.install_signal_handlers()

    def send_sigterm() -> None:
        wait_for(lambda: fw._waiting_idle, 20, "the worker waiting on its wake list", interval=0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=send_sigterm, daemon=True)
    try:
        sender.start()
        t0 = time.monotonic()
        fw.run()
        stopped_after = time.monotonic() - t0
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    sender.join(5)
    assert fw.stopping.is_set()
    assert stopped_after < 10, f"the worker waited out its idle wait ({stopped_after:.1f}s)"
    fw.redis.ping()  # the connection the signal interrupted was dropped, a new one works
