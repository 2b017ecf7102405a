"""Recovery paths with real worker processes: graceful drain on SIGTERM, the reaper's retry limit,
wall and queue timeouts, in-flight ids a worker never started, and duplicate queue entries."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from redis import Redis
from rq import Queue
from rq.serializers import JSONSerializer

from backends.contract.keys import (
    ATTEMPT_FIELD,
    DIED_ON_FIELD,
    JOB_FUNCTION,
    WORKERS_SET,
    inflight_key,
    job_key,
    queue_key,
    worker_key,
)
from dispatcher import Fleet, JobFailed
from tests.harness import wait_for
from tests.reliability_checks import assert_exactly_one_final, fleet_workers, held, streaming, wait_streaming

pytestmark = pytest.mark.timeout(180)
QUEUE = "llm:default"
# the fake engine, a step every 50 ms: a 40-word job takes 2 s like a small model's; what drains or
# times out is the worker's loop, the same for every engine
PACED = {"backend__type": "fake", "backend__step_delay": 0.05}
WORDS = " ".join(f"w{i}" for i in range(2000))


def test_sigterm_drain_finishes_eight_in_flight(redis_url: str, redis: Redis, tmp_path: Path) -> None:
    fleet = Fleet(redis_url)
    with fleet_workers(redis_url, tmp_path / "logs") as workers:
        worker = workers.start("d1", **PACED, backend__slots=8, drain_grace=60)
        jobs = [fleet.submit(prompt=f"Recipe {i}: take {WORDS}", max_tokens=40, temperature=0.0)
                for i in range(8)]
        wait_streaming(redis, "d1", at_least=8)
        assert worker.stop(signal.SIGTERM, timeout=90) == 0, worker.output()
    results = [job.result(timeout=5) for job in jobs]
    assert all(r["attempt"] == 1 and r["worker"] == "d1" for r in results)
    assert_exactly_one_final(redis, [j.id for j in jobs])
    assert not redis.exists(worker_key("d1")) and not redis.llen(inflight_key("d1"))
    assert "draining 8 jobs" in worker.output()


def test_sigterm_drain_requeues_what_outlasts_the_grace(redis_url: str, redis: Redis, tmp_path: Path) -> None:
    """8 long jobs in flight and 2 waiting; grace 0.5 s: the 8 go back to the FRONT of the queue
    (attempt 2), and a second worker finishes all 10, each once."""
    fleet = Fleet(redis_url)
    long_prompt = " ".join(f"w{i}" for i in range(8000))
    with fleet_workers(redis_url, tmp_path / "logs") as workers:
        # 1 ms a token: 8,000 tokens outlast the grace whatever the worker's write cadence
        first = workers.start("g1", backend__type="fake", backend__slots=8, backend__step_delay=0.001,
                              drain_grace=0.5)
        running = [fleet.submit(prompt=long_prompt, max_tokens=8000) for _ in range(8)]
        wait_for(lambda: len(streaming(redis, "g1")) == 8, 60, "8 jobs generating")
        waiting = [fleet.submit(prompt="short one", max_tokens=4) for _ in range(2)]
        assert first.stop(signal.SIGTERM, timeout=30) == 0, first.output()
        queued = [raw.decode() for raw in redis.lrange(queue_key(QUEUE), 0, -1)]
        assert set(queued[:8]) == {j.id for j in running} and queued[8:] == [j.id for j in waiting]
        workers.start("g2", backend__type="fake", backend__slots=8)
        results = {job.id: job.result(timeout=90) for job in running + waiting}
    assert all(results[j.id]["attempt"] == 2 and results[j.id]["worker"] == "g2" for j in running)
    assert_exactly_one_final(redis, list(results))


def test_reaper_gives_up_after_max_attempts_naming_the_dead_workers(
    redis_url: str, redis: Redis, tmp_path: Path
) -> None:
    """Two jobs held by a worker that died ('ghost-c'): one already died on ghost-a and ghost-b
    (its 3rd attempt), the other on its 1st. A live worker's reaper fails the first with all three
    names and runs the second again, within 15 s."""
    fleet = Fleet(redis_url)
    spent = fleet.submit(prompt="third time unlucky", max_tokens=4)
    fresh = fleet.submit(prompt="first time lucky", max_tokens=4)
    for _ in range(2):  # both into the dead worker's hands
        redis.lmove(queue_key(QUEUE), inflight_key("ghost-c"), "LEFT", "RIGHT")
    redis.hset(job_key(spent.id), mapping={ATTEMPT_FIELD: 2, DIED_ON_FIELD: "ghost-a,ghost-b"})
    redis.sadd(WORKERS_SET, "ghost-c")
    with fleet_workers(redis_url, tmp_path / "logs") as workers:
        started = time.monotonic()
        workers.start("alive", backend__type="fake", max_attempts=3)
        with pytest.raises(JobFailed) as failed:
            spent.result(timeout=30)
        recovered = fresh.result(timeout=30)
        elapsed = time.monotonic() - started
    assert "gave up after 3 attempts" in failed.value.error
    assert "ghost-a, ghost-b, ghost-c" in failed.value.error
    assert recovered["attempt"] == 2 and recovered["worker"] == "alive"
    assert elapsed < 15, f"reaping took {elapsed:.1f}s"
    assert not redis.exists(inflight_key("ghost-c")) and not redis.sismember(WORKERS_SET, "ghost-c")
    assert_exactly_one_final(redis, [spent.id, fresh.id])


def test_job_wall_timeout(redis_url: str, tmp_path: Path) -> None:
    fleet = Fleet(redis_url)
    with fleet_workers(redis_url, tmp_path / "logs") as workers:
        workers.start("t1", **PACED, backend__slots=2)
        started = time.monotonic()
        job = fleet.submit(prompt=f"An endless story: {WORDS}", max_tokens=2000, job_timeout=2)
        with pytest.raises(JobFailed) as failed:
            job.result(timeout=60)
        elapsed = time.monotonic() - started
        assert fleet.submit(prompt="Still serving:", max_tokens=4).result(timeout=30)["worker"] == "t1"
    assert "timed out: ran longer than 2s" in failed.value.error
    assert elapsed < 15, f"a 2 s timeout took {elapsed:.1f}s to fire"


def test_queue_ttl_expires_jobs_that_waited_too_long(redis_url: str, tmp_path: Path) -> None:
    fleet = Fleet(redis_url)
    stale = fleet.submit(prompt="too late", max_tokens=4, queue_ttl=1)
    patient = fleet.submit(prompt="in time", max_tokens=4, queue_ttl=120)
    plain = fleet.submit(prompt="no limit", max_tokens=4)
    time.sleep(2)
    with fleet_workers(redis_url, tmp_path / "logs") as workers:
        workers.start("q1", backend__type="fake")
        with pytest.raises(JobFailed) as failed:
            stale.result(timeout=30)
        assert patient.result(timeout=30)["text"] == "in time"
        assert plain.result(timeout=30)["text"] == "no limit"
    assert failed.value.error.startswith("expired: waited ") and "queue_ttl is 1s" in failed.value.error
    assert stale.status() == "failed"


def test_an_id_in_the_inflight_list_that_never_started_is_run(redis_url: str, redis: Redis,
                                                               tmp_path: Path) -> None:
    """A claim whose reply was lost leaves the id in the worker's list unknown to the loop: the
    loop's periodic check with Redis starts it."""
    with fleet_workers(redis_url, tmp_path / "logs") as workers:
        # the check runs every reconcile_interval (5 s by default); 1 s finds it sooner
        workers.start("o1", backend__type="fake", reconcile_interval=1)
        other = Queue("elsewhere", connection=redis, serializer=JSONSerializer)
        rq_job = other.enqueue(JOB_FUNCTION, {"prompt": "found again"})
        redis.lmove(queue_key("elsewhere"), inflight_key("o1"), "LEFT", "RIGHT")
        result = Fleet(redis_url).job(rq_job.id).result(timeout=20)
    assert result["text"] == "found again" and result["worker"] == "o1"
    assert_exactly_one_final(redis, [rq_job.id])


def test_a_job_pushed_twice_runs_once(redis_url: str, redis: Redis, tmp_path: Path) -> None:
    fleet = Fleet(redis_url)
    job = fleet.submit(prompt="only once please", max_tokens=8)
    redis.rpush(queue_key(QUEUE), job.id, job.id)
    with fleet_workers(redis_url, tmp_path / "logs") as workers:
        workers.start("p1", backend__type="fake", backend__slots=4)
        assert job.result(timeout=20)["text"] == "only once please"
        wait_for(lambda: not redis.llen(queue_key(QUEUE)) and not held(redis, "p1"), 10, "copies dropped")
        time.sleep(0.5)
    assert_exactly_one_final(redis, [job.id])


def test_a_live_worker_registers_with_rq_again_when_its_registration_is_lost(
    redis_url: str, redis: Redis, tmp_path: Path
) -> None:
    """E.g. Redis restarted without persistence, or a reaper took it for dead while it was cut off:
    `rq info` must list it again within a heartbeat or two."""
    with fleet_workers(redis_url, tmp_path / "logs") as workers:
        worker = workers.start("rr1", backend__type="fake")
        redis.delete("rq:worker:rr1")
        redis.srem("rq:workers", "rq:worker:rr1")
        wait_for(lambda: redis.sismember("rq:workers", "rq:worker:rr1"), 10, "RQ registration again")
        assert redis.hget("rq:worker:rr1", "queues") == b"llm:high,llm:default,llm:low"
        assert "re-registered rr1 with RQ" in worker.output()
