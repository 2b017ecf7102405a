"""Issue 10, defects 2, 3, 5, 10 and 11 (reaper prefix match, claim fairness): who owns a job,
with lost replies injected by a proxy that cuts the connection after Redis applied a command.
In-process workers on the fake engine against a real redis-server."""

from __future__ import annotations

from typing import Any

import pytest
from redis import Redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from backends.contract.keys import (
    ATTEMPT_FIELD,
    JOB_FUNCTION,
    OWNER_FIELD,
    inflight_key,
    job_key,
    queue_key,
    queue_names,
    worker_key,
)
from dispatcher import Fleet
from tests.lossy import LossyProxy, inproc_worker, long_prompt, run_until
from tests.reliability_checks import assert_exactly_one_final, final_entries, stream_events
from worker.claiming.claim import Claimer
from worker.liveness.reaper import Reaper

pytestmark = pytest.mark.timeout(120)
QUEUE = "llm:default"
WIP = f"rq:wip:{QUEUE}"


def _wip_members(redis: Redis, job_id: str) -> list[bytes]:
    members = [bytes(m) for m in redis.zrange(WIP, 0, -1)]  # type: ignore[arg-type]
    return [m for m in members if m.startswith(job_id.encode() + b":")]


def test_lost_reply_while_marking_started_resumes_the_job(redis_server: Any, redis: Redis) -> None:
    """Defect 2: the start's MULTI applies, its reply is lost (four times: redis-py's own three
    retries too). The worker owns the job, so it resumes it: one result, nothing left behind."""
    proxy = LossyProxy(redis_server.port)
    job = Fleet(redis_server.url).submit(prompt="resume me please", max_tokens=8)
    fw = inproc_worker(proxy.url, "s1")
    proxy.lose_reply(b"started_at", times=4)
    run_until([fw], lambda: final_entries(redis, job.id), 60, "the job's final entry")
    assert proxy.lost >= 1
    assert job.result(timeout=1)["text"] == "resume me please"
    assert_exactly_one_final(redis, [job.id])
    assert not redis.llen(inflight_key("s1")) and not _wip_members(redis, job.id)


def test_a_copy_of_a_running_job_is_refused_by_the_claim(redis_url: str, redis: Redis) -> None:
    """Defect 3: plain RQ re-enqueues a job while a1 runs it; a2 claims the copy. The claim script
    sees a1 holds it and drops the copy: the job runs once and ends once."""
    job = Fleet(redis_url).submit(prompt=long_prompt(200), max_tokens=200)
    a1 = inproc_worker(redis_url, "a1")
    a2 = inproc_worker(redis_url, "a2")
    run_until([a1], lambda: job.id in a1.inflight and a1.inflight[job.id].sent > 0, what="a1 streaming")
    rq_job = Job.fetch(job.id, connection=redis, serializer=JSONSerializer)
    Queue(QUEUE, connection=redis, serializer=JSONSerializer).enqueue_job(rq_job)  # RQ's own re-enqueue
    assert a2.claimer.claim(4) == []
    run_until([a1], lambda: final_entries(redis, job.id) and not a1.inflight, 60, "the end")
    for _ in range(3):  # an idle turn blocks IDLE_WAIT on the wake list
        a2.run_once()
    assert job.id not in a2.backend.admitted  # type: ignore[attr-defined]
    assert_exactly_one_final(redis, [job.id])


def test_lost_requeue_reply_leaves_no_rq_execution(redis_server: Any, redis: Redis) -> None:
    """Defect 5: the engine fails the job (retryable), the requeue script applies but its reply is
    lost. Once the job is back in its queue, no execution of the first attempt may stay in
    rq:wip (`rq info` would fail the job as abandoned)."""
    proxy = LossyProxy(redis_server.port)
    job = Fleet(redis_server.url).submit(prompt=long_prompt(20), max_tokens=20)
    fw = inproc_worker(proxy.url, "r1", fail_after=3)
    redis.script_load(fw.writes.requeue_script.script)  # EVALSHA runs (a NOSCRIPT reply lost would not)
    proxy.lose_reply(fw.writes.requeue_script.sha.encode(), times=4)
    run_until([fw], lambda: redis.lrange(queue_key(QUEUE), 0, -1) == [job.id.encode()] and not fw.to_requeue,
              30, "the job back in its queue")
    assert proxy.lost >= 1
    assert redis.hget(job_key(job.id), ATTEMPT_FIELD) == b"1"
    assert not _wip_members(redis, job.id), redis.zrange(WIP, 0, -1)


def test_a_reaped_worker_cannot_start_or_write_the_job_it_lost(redis_url: str, redis: Redis) -> None:
    """Defect 10: w1 claimed the job and was presumed dead before starting it; the reaper handed
    it back (attempt 2). w1's late start must not run it outside its in-flight list (where its
    result would be fenced off and the job never end); the job runs once from a real claim and
    its text is one run's."""
    job = Fleet(redis_url).submit(prompt=long_prompt(30), max_tokens=30)
    w1 = inproc_worker(redis_url, "w1")
    w2 = inproc_worker(redis_url, "w2", alive=redis)
    claimed = w1.claimer.claim(1)
    w1.unstarted.extend((raw, queue, w1.claimer.server_ms) for raw, queue in claimed)
    assert Reaper(redis, "w2", 3, 60).reap() == 1  # w1 has no status key: dead
    run_until([w1, w2], lambda: final_entries(redis, job.id), 60, "the job's result")
    result = job.result(timeout=1)
    texts = [e for e in stream_events(redis, job.id) if e.kind == "text" and e.attempt == result["attempt"]]
    assert [e.seq for e in texts] == list(range(len(texts)))  # one run's deltas, in order, once
    assert result["attempt"] == 2 and result["text"] == long_prompt(30)
    assert_exactly_one_final(redis, [job.id])


def test_a_restart_marker_never_lowers_the_attempt(redis_url: str, redis: Redis) -> None:
    """Defect 10: an engine restart writes the job's new attempt number only upwards, and only
    while the worker owns the job."""
    from worker.serving import endings

    job = Fleet(redis_url).submit(prompt="a b c", max_tokens=3)
    fw = inproc_worker(redis_url, "m1")
    run_until([fw], lambda: job.id in fw.inflight, what="started")
    claimed = fw.inflight[job.id]
    redis.hset(job_key(job.id), ATTEMPT_FIELD, 5)  # someone moved the job on to attempt 6
    claimed.attempt, claimed.attempt_dirty, claimed.unsent = 2, True, ["late"]
    with redis.pipeline(transaction=False) as pipe:
        endings.write_text(claimed, pipe, "m1")
        pipe.execute()
    assert redis.hget(job_key(job.id), ATTEMPT_FIELD) == b"5"


def test_reaping_one_job_keeps_the_execution_of_an_id_it_prefixes(redis_url: str, redis: Redis) -> None:
    """Defect 11: job 'job1' on a dead worker, 'job10' running on a live one. Reaping job1 must
    not remove job10's execution from rq:wip."""
    q = Queue(QUEUE, connection=redis, serializer=JSONSerializer)
    q.enqueue(JOB_FUNCTION, {"prompt": long_prompt(50)}, job_id="job1")
    dead = inproc_worker(redis_url, "dead1", slots=1)
    run_until([dead], lambda: "job1" in dead.inflight, what="job1 started")
    q.enqueue(JOB_FUNCTION, {"prompt": long_prompt(500)}, job_id="job10")
    live = inproc_worker(redis_url, "live1", slots=1, alive=redis)
    run_until([live], lambda: "job10" in live.inflight, what="job10 started")
    assert _wip_members(redis, "job10")
    Reaper(redis, "live1", 3, 60).reap()
    assert redis.lrange(queue_key(QUEUE), 0, -1) == [b"job1"]
    assert _wip_members(redis, "job10")


def test_low_priority_moves_under_sustained_high_load(redis_url: str, redis: Redis) -> None:
    """Defect 11: 40 high and 5 low jobs queued: of 16 claims, 4 come from low (2 in 8 while
    default is empty)."""
    fleet = Fleet(redis_url)
    for i in range(40):
        fleet.submit(prompt=f"high {i}", priority="high")
    low = {fleet.submit(prompt=f"low {i}", priority="low").id for i in range(5)}
    fw = inproc_worker(redis_url, "f1", slots=16)
    claimed = fw.claimer.claim(16)
    assert len(claimed) == 16
    # picks 4 and 8 of each 8 start below high; default is empty, so both go to low
    assert sum(raw.decode() in low for raw, _ in claimed) == 4


def test_a_worker_the_fleet_takes_for_dead_does_not_claim(redis_server: Any, redis: Redis) -> None:
    """Defect 10, seen in tests/test_partition.py: a worker back from a Redis outage claimed jobs
    before its heartbeat re-registered it; the reaper, seeing no status key, took them back, and
    three rounds of that failed jobs "after 3 attempts". A worker process claims only while its
    status key exists."""
    job = Fleet(redis_server.url).submit(prompt="not for the dead", max_tokens=1)
    claimer = Claimer(redis, "ghost", queue_names("llm"))
    claimer.require_live = True  # as `fleet worker` sets once its heartbeat runs
    assert claimer.claim(4) == []
    assert redis.lrange(queue_key(QUEUE), 0, -1) == [job.id.encode()]
    assert not redis.exists(inflight_key("ghost")) and redis.hget(job_key(job.id), OWNER_FIELD) is None
    redis.hset(worker_key("ghost"), "state", '"idle"')  # the heartbeat registered it again
    assert claimer.claim(4) == [(job.id.encode(), QUEUE)]
    assert redis.lrange(inflight_key("ghost"), 0, -1) == [job.id.encode()]
