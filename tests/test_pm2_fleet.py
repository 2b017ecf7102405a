"""The generated ecosystem.config.js under real PM2, running real `fleet worker` processes.

Two workers, one per core of this box (CPU 0 and CPU 1): they come up pinned as planned, serve
jobs, and `pm2 delete` stops them without losing a job: PM2 sends SIGINT, the worker drains
(a short grace here, so the long jobs in flight are requeued), and after `pm2 start` again every
job ends with exactly one result.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from backends.contract.keys import inflight_key, queue_key, queue_name
from dispatcher import Fleet
from ecosystem.planner import Plan, plan
from ecosystem.render import RenderOptions, default_command, render_pm2
from ecosystem.topology import read_topology
from tests.cpuset import cpuset_cpus
from tests.fleet_checks import alive, cpus_allowed, registered, submit, thread_cpus, wait_streaming
from tests.harness import ROOT, wait_for
from tests.pm2 import Pm2

pytestmark = pytest.mark.model

DRAIN_GRACE = 1.0  # seconds: long jobs cannot finish in it, so the drain requeues them


@pytest.fixture
def pm2() -> Iterator[Pm2]:
    home = Path(tempfile.mkdtemp(prefix="fleet-pm2-"))  # short: PM2's sockets live here
    manager = Pm2(home)
    yield manager
    manager.kill()
    shutil.rmtree(home, ignore_errors=True)


def two_worker_plan() -> Plan:
    # the box's cores, not the one a pinned test runner has: pin() moves each worker onto its own
    topology = read_topology("/sys", allowed=cpuset_cpus())
    return plan(topology, workers=2, slots=3)


def write_config(the_plan: Plan, redis_url: str, where: Path) -> Path:
    options = RenderOptions(
        command=default_command(),
        config_path=str(ROOT / "worker-config.json"),
        cwd=str(ROOT),
        drain_grace=DRAIN_GRACE,
        extra_env={
            "FLEET_REDIS_URL": redis_url,
            "FLEET_DRAIN_GRACE": str(DRAIN_GRACE),
            "FLEET_BACKEND__N_CTX": "2048",
            "PYTHONUNBUFFERED": "1",
        },
    )
    path = where / "ecosystem.config.js"
    path.write_text(render_pm2(the_plan, options))
    return path


# alone: workers pinned to cores 0 and 1; which long jobs the drain finishes and which it hands
# back (attempt 1 or 2) must not hang on other tests' load on those cores
@pytest.mark.alone
def test_pm2_fleet_pinned_serves_and_loses_no_job(pm2: Pm2, redis_url: str) -> None:
    the_plan = two_worker_plan()
    names = [w.name for w in the_plan.workers]
    config = write_config(the_plan, redis_url, pm2.home)
    pm2.check("start", str(config))

    # -- up, pinned as planned -------------------------------------------------------------------
    rows = registered(redis_url, names)
    apps = pm2.apps()
    assert sorted(apps) == sorted(names)
    for w in the_plan.workers:
        pid = int(rows[w.name]["pid"])
        assert apps[w.name]["pid"] == pid  # PM2 runs the worker itself, no wrapper process
        assert cpus_allowed(pid) == w.cpu_list, w
        assert thread_cpus(pid) == {w.cpu_list}  # llama.cpp's threads inherited the pin
        assert rows[w.name]["cpus"] == w.cpu_list
        assert rows[w.name]["numa_node"] == str(w.numa_node)
        assert int(rows[w.name]["slots"]) == 3
    assert [w.cpu_list for w in the_plan.workers] == ["0", "1"]

    # -- serving: both workers take jobs ---------------------------------------------------------
    fleet = Fleet(redis_url)
    results = [j.result(timeout=120) for j in submit(fleet, 6, 16, "warm-up")]
    assert all(r["text"] for r in results)
    assert {r["worker"] for r in results} == set(names)

    # -- pm2 delete with 6 long jobs in flight: drained, requeued, none lost ---------------------
    long_jobs = submit(fleet, 6, 200, "long")
    wait_streaming(redis_url, long_jobs)
    pids = [int(rows[n]["pid"]) for n in names]
    pm2.check("delete", "all", timeout=60)
    wait_for(lambda: not any(alive(p) for p in pids), 30, "the workers to exit")
    for name in names:  # PM2 stopped them with SIGINT, and they drained (worker logs go to stderr)
        log = "".join(f.read_text() for f in (pm2.home / "logs").glob(f"{name}-error*.log"))
        assert re.search(r"signal 2: draining [1-3] jobs", log), log[-2000:]
    redis = Redis.from_url(redis_url)
    raw = redis.lrange(queue_key(queue_name("llm", "default")), 0, -1)
    queued = [q if isinstance(q, str) else q.decode() for q in raw]
    finished = [j for j in long_jobs if j.status() == "finished"]
    assert len(queued) + len(finished) == len(long_jobs)  # each job either done or back in line
    assert queued, "the drain grace is shorter than a long job: some must have been requeued"
    assert all(redis.llen(inflight_key(n)) == 0 for n in names)  # nothing held by a stopped worker

    # -- pm2 start again: the requeued jobs run to one result each -------------------------------
    pm2.check("start", str(config))
    registered(redis_url, names)
    done = [j.result(timeout=180) for j in long_jobs]
    assert [r["job_id"] for r in done] == [j.id for j in long_jobs]
    requeued_ids = set(queued)
    for r in done:
        assert r["attempt"] == (2 if r["job_id"] in requeued_ids else 1), r
        assert r["usage"]["completion_tokens"] == 200 or r["finish_reason"] == "stop"
        # one final stream entry per job: the stream ends exactly once
        assert "".join(fleet.job(r["job_id"]).stream(timeout=10)) == r["text"]
    pm2.check("delete", "all", timeout=60)
