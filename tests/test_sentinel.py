"""Redis Sentinel failover under load: 1 primary, 1 replica, 3 Sentinels (real redis-server and
`redis-server --sentinel` processes), two workers and a producer on a `redis+sentinel://` URL.

Workers run the fake backend, paced like a short real generation (2 s a job): the subject is
the fleet riding out a failover, not the engine; job volume: 300, submitted while it happens.

The primary is killed with SIGKILL mid-run. Must hold: workers and the producer go on against
the promoted replica without a restart; with `durability="replicated"` every job whose submit
returned ends with a result. Replicated submits wait while no replica is attached, so the killed
server is started again (as its supervisor would) and the Sentinels make it the new replica.
The failover timeline goes to stdout and failover-timeline.json.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis

from backends.contract.connect import redis_from_url
from backends.contract.keys import worker_key
from dispatcher import Fleet, FleetJob
from tests.multihost_checks import (
    WORDS_PER_JOB,
    Timeline,
    final_counts,
    prompt,
    start_worker_in,
    whereabouts,
)
from tests.reliability_checks import stream_events
from tests.sentinel import SentinelCluster

JOBS = 300


def test_workers_and_producers_follow_a_failover(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    with SentinelCluster.start(tmp_path / "redis") as sc:
        watch = redis_from_url(sc.url, socket_timeout=5, socket_connect_timeout=2)
        logs = tmp_path / "logs"
        workers = []
        for name in ("s1", "s2"):
            workers.append(start_worker_in(None, None, sc.url, name, logs, watch))
            request.addfinalizer(workers[-1].kill)  # never left running after the test
        fleet = Fleet(sc.url, durability="replicated", retry_for=60)
        acked: list[tuple[FleetJob, float]] = []  # jobs whose submit returned, and when
        errors: list[BaseException] = []

        def produce() -> None:
            try:
                for i in range(JOBS):
                    job = fleet.submit(prompt(i), max_tokens=WORDS_PER_JOB, temperature=0)
                    acked.append((job, time.monotonic()))
                    time.sleep(0.05)
            except BaseException as e:  # surfaced below: a submit must not fail over a failover
                errors.append(e)

        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        tl = Timeline()
        tl.when("60 jobs acknowledged", lambda: len(acked) >= 60, 60)
        def ended_count() -> int:
            try:
                return sum(1 for n in final_counts(watch, [j.id for j, _ in acked]).values() if n)
            except redis.exceptions.ConnectionError:  # the test's own reader, mid-failover
                return -1  # (no master yet): ask again on the next poll

        before = ended_count()
        old = sc.kill_primary()
        t_kill = time.monotonic()
        tl.mark("primary killed")
        tl.when("replica promoted", lambda: sc.primary_port() != old, 60)
        tl.when("workers finish jobs again", lambda: ended_count() > before + 8, 60)
        # replicated submits need a replica: until one is back they wait (up to retry_for)
        sc.restart(old)
        tl.mark("old primary restarted")
        tl.when("first submit acknowledged after the kill", lambda: any(t > t_kill for _, t in acked), 60)
        producer.join(120)
        tl.mark("all submitted")
        assert not errors, f"submit failed across the failover: {errors[0]!r}"
        ids = [j.id for j, _ in acked]
        try:
            tl.when("all jobs ended", lambda: ended_count() == len(ids), 180)
        except TimeoutError:
            logs_tail = "\n".join(w.output()[-2000:] for w in workers)
            raise AssertionError(f"jobs never ended:\n{whereabouts(watch, ids, ['s1', 's2'])}\n"
                                 f"worker logs:\n{logs_tail}") from None
        counts = final_counts(watch, ids)
        results = {}
        for job_id in ids:
            finals = [ev for ev in stream_events(watch, job_id) if ev.final]
            results[job_id] = finals[-1].kind if finals else None
        record = tl.dump(tmp_path / "failover-timeline.json", jobs=len(ids), killed_port=old,
                         promoted_port=sc.primary_port(),
                         failover_s=round(tl.marks["replica promoted"] - tl.marks["primary killed"], 2),
                         jobs_with_two_finals=sum(1 for n in counts.values() if n > 1))

        assert len(ids) == JOBS
        lost = [j for j, kind in results.items() if kind != "done"]
        assert not lost, f"{len(lost)} acknowledged jobs lost or failed: {lost[:5]}"
        assert all(w.alive() for w in workers), "a worker exited instead of following the failover"
        assert all(watch.exists(worker_key(w.name)) for w in workers)
        assert record["failover_s"] < 30
