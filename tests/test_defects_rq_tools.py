"""RQ's own tools against the stream rules. Supported: `rq requeue` /
FailedJobRegistry.requeue (a new attempt number), RQ's job.cancel() on a queued job (a final
`cancelled` entry) and on a running one (it stops, and stays cancelled)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from backends.contract.keys import job_key
from dispatcher import Fleet, JobFailed
from tests.lossy import inproc_worker, long_prompt, run_until
from tests.reliability_checks import assert_exactly_one_final, final_entries, fleet_workers

pytestmark = pytest.mark.timeout(120)
QUEUE = "llm:default"


def _rq_job(redis: Redis, job_id: str) -> Job:
    return Job.fetch(job_id, connection=redis, serializer=JSONSerializer)


def test_rq_requeue_of_a_failed_job_runs_as_a_new_attempt(redis_url: str, redis: Redis) -> None:
    """The first run fails; RQ's registry requeues it. A reader that starts after the requeue gets
    the re-run's result, not the old error; the stream's final entries are one per attempt."""
    fleet = Fleet(redis_url)
    job = fleet.submit(prompt="try again", max_tokens=4)
    broken = inproc_worker(redis_url, "b1", fail_after=0, max_attempts=1)
    run_until([broken], lambda: final_entries(redis, job.id), what="the failure")
    with pytest.raises(JobFailed):
        job.result(timeout=1)
    FailedJobRegistry(QUEUE, connection=redis, serializer=JSONSerializer).requeue(job.id)
    got: dict[str, Any] = {}
    reader = threading.Thread(target=lambda: got.update(job.result(timeout=60)), daemon=True)
    reader.start()
    streamed: list[str] = []
    streamer = threading.Thread(target=lambda: streamed.extend(job.stream(timeout=60)), daemon=True)
    streamer.start()
    healthy = inproc_worker(redis_url, "h1")
    run_until([healthy], lambda: len(final_entries(redis, job.id)) == 2, what="the re-run's result")
    reader.join(10)
    streamer.join(10)
    assert got.get("text") == "try again" and got.get("attempt") == 2
    assert "".join(streamed) == "try again"
    assert job.result(timeout=1)["attempt"] == 2  # a reader from now on too
    assert [e.attempt for e in final_entries(redis, job.id)] == [1, 2]
    assert 0 < redis.ttl(job_key(job.id)) <= 3600


def test_rq_cancel_of_a_running_job_stops_it_and_it_stays_cancelled(redis_url: str, redis: Redis) -> None:
    job = Fleet(redis_url).submit(prompt=long_prompt(400), max_tokens=400)
    fw = inproc_worker(redis_url, "c1")
    run_until([fw], lambda: job.id in fw.inflight and fw.inflight[job.id].sent > 0, what="streaming")
    _rq_job(redis, job.id).cancel()
    run_until([fw], lambda: final_entries(redis, job.id), what="the final entry")
    result = job.result(timeout=1)
    assert result["finish_reason"] == "cancelled"
    assert len(result["text"].split()) < 400
    assert redis.hget(job_key(job.id), "status") == b"canceled"
    assert_exactly_one_final(redis, [job.id])


def test_rq_cancel_of_a_queued_job_gets_a_final_entry(redis_url: str, redis: Redis, tmp_path: Path) -> None:
    """RQ's cancel takes the job off its queue and writes no stream entry: a fleet reader would
    wait for ever. A worker's housekeeping ends it (cancelled) and sets its TTL."""
    fleet = Fleet(redis_url)
    job = fleet.submit(prompt="never mind", max_tokens=4)
    _rq_job(redis, job.id).cancel()
    with fleet_workers(redis_url, tmp_path / "logs") as workers:
        workers.start("q1", backend__type="fake", result_ttl=120)
        result = job.result(timeout=30)
    assert result["finish_reason"] == "cancelled" and result["text"] == ""
    assert 0 < redis.ttl(job_key(job.id)) <= 120
    assert len(final_entries(redis, job.id)) == 1  # (no RQ result: like a queued job the fleet cancels)
