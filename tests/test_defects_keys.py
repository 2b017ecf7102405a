"""Every key the fleet or RQ writes for a job ends with a TTL or is removed,
and RQ's registries of ended jobs are trimmed; the private Redis offers
`appendfsync always`."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from redis import Redis
from rq import Queue
from rq.serializers import JSONSerializer

from backends.contract.keys import JOB_FUNCTION, job_key, stream_key
from backends.contract.replies import as_str
from dispatcher import Fleet, JobFailed
from ecosystem.private_redis import PrivateRedis
from tests.harness import wait_for
from tests.lossy import long_prompt
from tests.reliability_checks import fleet_workers, streaming

pytestmark = pytest.mark.timeout(180)
QUEUE = "llm:default"
KEPT_WHILE_IDLE = {b"fleet:owners", b"rq:queues"}  # workers that claimed; RQ's set of queue names
# docs/observability.md: job history (24 h), counters and histograms (90 days); docs/tenants.md:
# usage per tenant (8 days), its spend per day (33 days) and this minute's rate counts (120 s);
# placement: workers' free slots (60 s) and the prefixes they hold (600 s); each with a TTL
OBSERVABILITY = ("fleet:history", "fleet:counters:", "fleet:hist:", "fleet:pools", "fleet:usage:",
                 "fleet:spend:", "fleet:tenant:", "fleet:capacity:", "fleet:held:")


def test_ended_jobs_leave_no_keys_behind(redis_url: str, redis: Redis, tmp_path: Path) -> None:
    """A finished, a failed and a cancelled-while-running job with result_ttl 2 s: within a few
    seconds after, Redis holds what the idle fleet held before them (plus the two sets above),
    registries included, and while they wait every job key has a TTL."""
    fleet = Fleet(redis_url, result_ttl=2)
    with fleet_workers(redis_url, tmp_path / "logs") as workers:
        workers.start("e1", backend__type="fake", result_ttl=2)
        idle = set(redis.keys())
        finished = fleet.submit(prompt="fine thanks", max_tokens=2)
        failed = Queue(QUEUE, connection=redis, serializer=JSONSerializer).enqueue(
            JOB_FUNCTION, {"prompt": "   "}, result_ttl=2, failure_ttl=2)
        cancelled = fleet.submit(prompt=long_prompt(20000), max_tokens=8000)
        assert finished.result(timeout=30)["text"] == "fine thanks"
        with pytest.raises(JobFailed):
            fleet.job(failed.id).result(timeout=30)
        wait_for(lambda: cancelled.id in streaming(redis, "e1"), 30, "the long job streaming")
        assert cancelled.cancel() == "cancelling"
        assert cancelled.result(timeout=30)["finish_reason"] == "cancelled"
        for job_id in (finished.id, failed.id, cancelled.id):
            for key in (job_key(job_id), stream_key(job_id), f"rq:results:{job_id}"):
                assert 0 < redis.ttl(key) <= 2 or not redis.exists(key), key
        leftover = lambda: {k for k in set(redis.keys()) - idle - KEPT_WHILE_IDLE  # noqa: E731
                            if not str(as_str(k)).startswith(OBSERVABILITY)}
        wait_for(lambda: not leftover(), 30, "the ended jobs' keys and registry entries to go")
        kept = [k for k in redis.scan_iter() if str(as_str(k)).startswith(OBSERVABILITY)]
        # history and counters: their own TTLs (-1: none); one may expire between SCAN and TTL (-2)
        assert not [k for k in kept if redis.ttl(k) == -1], kept
    for registry in ("finished", "failed", "canceled"):
        assert not redis.exists(f"rq:{registry}:{QUEUE}")


def test_a_job_cancelled_while_queued_expires(redis_url: str, redis: Redis) -> None:
    fleet = Fleet(redis_url, pool="nobody-serves", result_ttl=30)
    job = fleet.submit(prompt="not needed")
    assert job.cancel() == "cancelled"
    assert 0 < redis.ttl(job_key(job.id)) <= 30 and 0 < redis.ttl(stream_key(job.id)) <= 30


def test_the_private_redis_can_fsync_every_write(tmp_path: Path) -> None:
    assert "appendfsync everysec" in PrivateRedis("127.0.0.1", 6379).config(tmp_path)
    assert "appendfsync always" in PrivateRedis("127.0.0.1", 6379, appendfsync="always").config(tmp_path)
    from ecosystem.cli import cli

    out = CliRunner().invoke(cli, ["up", "--help"]).output
    assert "--redis-fsync [everysec|always]" in out


def test_a_heartbeat_racing_the_final_write_does_not_bring_the_execution_back(redis_url: str,
                                                                              redis: Redis) -> None:
    """Defect 1 (found by scripts/reliability_keys.py): the heartbeat thread lists the in-flight
    jobs, the loop writes one's ending (deleting its RQ execution), then the beat refreshes that
    execution: RQ's Execution.heartbeat() re-created it with a 10-minute TTL."""
    from rq.worker import Worker

    from backends.contract.keys import queue_names
    from tests.lossy import inproc_worker, run_until
    from tests.reliability_checks import final_entries
    from worker.liveness.heartbeat import Heartbeat
    from worker.liveness.reaper import Reaper

    job = Fleet(redis_url).submit(prompt="a b c d", max_tokens=4)
    fw = inproc_worker(redis_url, "hb2")
    run_until([fw], lambda: job.id in fw.inflight, what="started")
    listed = fw.inflight[job.id]  # what the heartbeat thread saw
    run_until([fw], lambda: final_entries(redis, job.id), what="the result")
    assert listed.execution is not None and not redis.exists(listed.execution.key)
    fw.inflight[job.id] = listed
    rq_worker = Worker(queue_names("llm"), name="hb2", connection=fw.redis, serializer=JSONSerializer)
    rq_worker.register_birth()
    Heartbeat(fw, rq_worker, Reaper(fw.redis, "hb2", 3, 60), {"name": "hb2"}).beat()
    assert not redis.exists(listed.execution.key)
    assert not redis.exists(f"rq:executions:{job.id}")
