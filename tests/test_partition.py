"""A worker host cut off from Redis longer than its heartbeat TTL, then reconnected.

Real redis-server in its own network namespace, two worker "hosts" in two others, joined by veth
pairs (tests/netns.py; needs root). Workers run the fake backend, paced like a short real
generation (2 s a job), because what is under test is the fleet's bookkeeping across a
partition, not the engine; job volume: 300.

Must hold: every job ends exactly once; no stream carries text from an attempt after a higher
attempt began (the cut-off worker's buffered tokens are fenced); the cut-off worker serves again
after the link returns. The measured timeline (cut -> reaped -> finished elsewhere -> rejoined)
goes to stdout and partition-timeline.json in the test's tmp dir.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import pytest
from redis import Redis

from backends.contract import stream
from backends.contract.keys import inflight_key, stream_key, worker_key
from dispatcher import Fleet
from tests.multihost_checks import Timeline, ended, final_counts, late_text, start_worker_in, submit_all
from tests.netns import NetLab, RedisInNamespace
from tests.reliability_checks import final_entries, held

JOBS = 300
CUT_S = 15.0


@pytest.fixture(scope="module")
def partition(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the scenario once; the tests below check what it left."""
    tmp_path = tmp_path_factory.mktemp("partition")
    with NetLab(["h1", "h2"]) as lab:
        rs = RedisInNamespace(lab, tmp_path / "redis").start()
        r = Redis.from_url(rs.unix_url)
        logs = tmp_path / "logs"
        start_worker_in(lab, "h1", rs.url_from("h1"), "w1", logs, r)
        start_worker_in(lab, "h2", rs.url_from("h2"), "w2", logs, r)
        fleet = Fleet(rs.unix_url)
        jobs = submit_all(fleet, JOBS)
        ids = [j.id for j in jobs]
        tl = Timeline()

        # cut h1 while it is mid-generation on a full set of slots
        tl.when("w1 generating", lambda: len(held(r, "w1")) >= 8 and r.xlen(stream_key(held(r, "w1")[0])) > 3,
                60)
        cut_off = held(r, "w1")
        lab.cut("h1")
        tl.mark("cut")
        tl.when("w1 heartbeat expired", lambda: not r.exists(worker_key("w1")), 30)
        tl.when("w1 jobs reaped", lambda: r.llen(inflight_key("w1")) == 0, 30)
        tl.when("w1 jobs finished elsewhere", lambda: all(final_counts(r, cut_off).values()), 60)
        time.sleep(max(0.0, CUT_S - tl.marks["w1 jobs finished elsewhere"] + tl.marks["cut"]))
        restored_ms = int(r.time()[0]) * 1000
        lab.restore("h1")
        tl.mark("restored")
        tl.when("w1 rejoined", lambda: r.exists(worker_key("w1")), 60)

        def w1_done_after_restore() -> int:
            n = 0
            for job_id in ids:
                for entry_id, fields in r.xrange(stream_key(job_id)):
                    at_ms = int(bytes(entry_id).split(b"-")[0])
                    ev = stream.decode(fields)
                    if ev.kind == "done" and at_ms > restored_ms and (ev.data or {}).get("worker") == "w1":
                        n += 1
            return n

        tl.when("w1 finished a job after rejoining", lambda: w1_done_after_restore() > 0, 90)
        tl.when("all jobs ended", lambda: ended(r, ids) == JOBS, 180)
        time.sleep(2)  # let any straggler writes land before checking
        counts = final_counts(r, ids)
        late = late_text(r, ids)
        # with the final entry each one got (its error names who failed it and why)
        wrong_status = {j.id: forensics(r, j.id) for j in jobs if j.status() != "finished"}
        tl.dump(tmp_path / "partition-timeline.json", jobs=JOBS, cut_s=CUT_S, cut_off_jobs=len(cut_off),
                w1_jobs_after_rejoin=w1_done_after_restore(), late_text_jobs=len(late),
                not_finished_status=wrong_status)

        return {"counts": counts, "late": late, "wrong_status": wrong_status,
                "w1_after_rejoin": w1_done_after_restore()}


def forensics(r: Redis, job_id: str) -> dict[str, Any]:
    """Who wrote what about a job: its final entries, its hash (RQ's failure text unpacked) and
    RQ's results stream (which names the writing worker)."""
    fields = {k.decode(): v for k, v in r.hgetall(f"rq:job:{job_id}").items()}
    exc = fields.get("exc_info")
    return {
        "status": fields.get("status", b"").decode(),
        "final_entries": [(e.kind, e.data) for e in final_entries(r, job_id)],
        "exc_info": zlib.decompress(exc).decode("utf-8", "replace")[-400:] if exc else None,
        "hash": {k: v.decode("utf-8", "replace")[:120] for k, v in fields.items()
                 if k not in ("data", "exc_info")},
        "rq_results": [{k.decode(): v.decode("utf-8", "replace")[:200] for k, v in f.items()}
                       for _id, f in r.xrange(f"rq:results:{job_id}")],
    }


def test_partitioned_host_is_fenced_and_rejoins(partition: dict[str, Any]) -> None:
    counts, late = partition["counts"], partition["late"]
    assert sorted(set(counts.values())) == [1], {j: n for j, n in counts.items() if n != 1}
    some = dict(list(late.items())[:5])
    assert not late, f"{len(late)} jobs got text from fenced attempts after their restart marker: {some}"
    assert partition["w1_after_rejoin"] > 0


def test_partitioned_host_rewrites_no_status(partition: dict[str, Any]) -> None:
    # every job finished: a fenced worker rewrites no status, and one back from the cut claims
    # nothing before its heartbeat registered it again (else the reaper took each claim back and
    # three rounds failed jobs "after 3 attempts"; backends/contract/queue/claim.lua). The job's hash and RQ
    # results name the writer if this ever fails.
    assert not partition["wrong_status"], partition["wrong_status"]
