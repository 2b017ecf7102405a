"""Issue 10, defects 6 (the reaper reads an owners index, never SCANs; the heartbeat never waits
on it), 8 (drain hand-backs do not use up max_attempts) and 9 (no cross-host wall clocks).
In-process workers on the fake engine against a real redis-server."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from redis import Redis
from rq.serializers import JSONSerializer
from rq.worker import Worker

from backends.contract.keys import queue_names, worker_key
from dispatcher import Fleet, JobFailed
from tests.harness import wait_for
from tests.lossy import inproc_worker, long_prompt, run_until
from tests.reliability_checks import final_entries
from worker.liveness.heartbeat import Heartbeat
from worker.liveness.reaper import Reaper
from worker.serving.loop import FleetWorker

pytestmark = pytest.mark.timeout(120)
_JUNK = "for i = 1, tonumber(ARGV[1]) do redis.call('SET', 'junk:' .. i, 'x') end"


def _scans(redis: Redis) -> int:
    stats = redis.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_scan", "cmdstat_keys"))


def _stream_a_little(fw: FleetWorker, job_id: str) -> None:
    run_until([fw], lambda: job_id in fw.inflight and fw.inflight[job_id].sent > 0, what="streaming")


def _start_then_stop(fw: FleetWorker, job_id: str) -> None:
    """Run the job a little, then drain with no grace: the job is handed back."""
    _stream_a_little(fw, job_id)
    fw.settings.drain_grace = 0
    fw.stop()
    fw.run()


def test_the_reaper_finds_dead_workers_without_scanning(redis_url: str, redis: Redis) -> None:
    """A worker that claimed a job and died before its first heartbeat: found through the owners
    index the claim script keeps, with 100,000 unrelated keys in Redis and no SCAN."""
    job = Fleet(redis_url).submit(prompt="find me", max_tokens=4)
    ghost = inproc_worker(redis_url, "ghost")
    assert ghost.claimer.claim(1)
    redis.eval(_JUNK, 0, 100_000)
    redis.config_resetstat()
    assert Reaper(redis, "reaper", 3, 60).reap() == 1
    assert _scans(redis) == 0
    healthy = inproc_worker(redis_url, "healthy")
    run_until([healthy], lambda: final_entries(redis, job.id), what="the job's result")
    assert job.result(timeout=1)["attempt"] == 2


class HeldReaper(Reaper):
    """A reap that does not end until the test lets it (one took 3 s with 1M keys and a busy
    Redis): `entered` once it runs, holding the reaper's thread until `release`."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.entered, self.release = threading.Event(), threading.Event()

    def reap(self) -> int:
        self.entered.set()
        self.release.wait(60)
        return 0


def test_the_heartbeat_never_waits_for_the_reaper(redis_url: str, redis: Redis) -> None:
    # the default interval (1 s, the status key's TTL 3 s): a beat late by a loaded box's
    # scheduling is no verdict on the reaper
    fw = inproc_worker(redis_url, "hb1", heartbeat_interval=1.0)
    rq_worker = Worker(queue_names("llm"), name="hb1", connection=fw.redis, serializer=JSONSerializer)
    rq_worker.register_birth()
    reaper = HeldReaper(fw.redis, "hb1", 3, 60)
    hb = Heartbeat(fw, rq_worker, reaper, {"name": "hb1"})
    hb.beat()
    hb.start()
    lowest_ttl = 10_000

    def beats_while_held() -> int:
        nonlocal lowest_ttl
        lowest_ttl = min(lowest_ttl, redis.pttl(worker_key("hb1")))
        return hb.beats - beats_before

    try:
        assert reaper.entered.wait(30), "the reaper never ran"
        # the reap holds the reaper's thread until released: the beats must go on meanwhile
        beats_before = hb.beats
        wait_for(lambda: beats_while_held() >= 5, 30, "5 beats while the reap is held")
        assert not reaper.release.is_set() and hb.reaping.is_alive()  # still inside the reap
    finally:
        reaper.release.set()
        hb.halt()
        hb.join(5)
    assert lowest_ttl > 0, "the worker's status key expired: it looked dead"


def test_drain_hand_backs_do_not_use_up_max_attempts(redis_url: str, redis: Redis) -> None:
    """max_attempts 2: two rolling restarts hand the job back, then its worker dies. That is its
    first failure, so it runs again (attempt 4) and completes."""
    job = Fleet(redis_url).submit(prompt=long_prompt(60), max_tokens=60)
    for name in ("d1", "d2"):
        _start_then_stop(inproc_worker(redis_url, name, max_attempts=2), job.id)
    dying = inproc_worker(redis_url, "d3", max_attempts=2)
    _stream_a_little(dying, job.id)
    Reaper(redis, "d4", 2, 60).reap()  # d3 never beat: dead
    survivor = inproc_worker(redis_url, "d4", max_attempts=2)
    run_until([survivor], lambda: final_entries(redis, job.id), what="the result")
    result = job.result(timeout=1)
    assert result["attempt"] == 4 and result["text"] == long_prompt(60)


def test_the_final_error_counts_drains_apart(redis_url: str, redis: Redis) -> None:
    job = Fleet(redis_url).submit(prompt=long_prompt(60), max_tokens=60)
    _start_then_stop(inproc_worker(redis_url, "x1", max_attempts=1), job.id)
    dying = inproc_worker(redis_url, "x2", max_attempts=1)
    _stream_a_little(dying, job.id)
    Reaper(redis, "x3", 1, 60).reap()
    with pytest.raises(JobFailed) as failed:
        job.result(timeout=5)
    assert "gave up after 1 attempts: the worker running it died each time (x2)" in failed.value.error
    assert "1 more runs were handed back by draining workers, not counted" in failed.value.error


def _skew(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """This host's wall clock jumps (NTP step, or simply another host's clock)."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + seconds)


def test_queue_ttl_uses_redis_time_not_the_workers_clock(redis_url: str, redis: Redis,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    job = Fleet(redis_url).submit(prompt="on time", max_tokens=2, queue_ttl=60)
    _skew(monkeypatch, 3600)  # the worker's clock is an hour ahead of the producer's
    fw = inproc_worker(redis_url, "clock1")
    run_until([fw], lambda: final_entries(redis, job.id), what="the result")
    assert job.result(timeout=1)["text"] == "on time"


def test_a_wall_clock_step_does_not_time_out_a_running_job(redis_url: str, redis: Redis,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    job = Fleet(redis_url).submit(prompt=long_prompt(40), max_tokens=40, job_timeout=60)
    fw = inproc_worker(redis_url, "clock2")
    run_until([fw], lambda: job.id in fw.inflight and fw.inflight[job.id].sent > 0, what="streaming")
    _skew(monkeypatch, 3600)
    run_until([fw], lambda: final_entries(redis, job.id), what="the result")
    result: dict[str, Any] = job.result(timeout=1)
    assert result["finish_reason"] == "length"

