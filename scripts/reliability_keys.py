"""Issue 10's numbers (not a test): keys and memory of a 10,000-job run, reap time with 1M keys.

    .venv/bin/python scripts/reliability_keys.py [--jobs 10000] [--out docs/bench-runs/reliability-keys.json]

1. A private redis-server and 2 `fleet worker` processes on the FAKE engine (the key/TTL
   bookkeeping is the same for every engine), result_ttl 30 s. Key count and used_memory of the
   idle fleet; 10,000 jobs; the peak while they run; the same after 60 s idle.
2. DEBUG POPULATE 1,000,000 unrelated keys; a dead worker holding 8 jobs; the time of each reap
   (in this process, as a worker's reaper thread runs it), while a heartbeat thread beats every
   second: its largest gap and the lowest TTL its status key had (the workers' own status keys
   are watched too: none may expire).
Writes one JSON object (and prints it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from redis import Redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.contract.keys import queue_names, worker_key  # noqa: E402
from backends.contract.replies import as_str  # noqa: E402
from dispatcher import Fleet  # noqa: E402
from ecosystem.local.processes import RedisServer, start_worker  # noqa: E402

RESULT_TTL = 30


def keys_and_memory(r: Redis) -> dict[str, int]:
    return {"keys": int(r.dbsize()), "used_memory": int(r.info("memory")["used_memory"])}


class Peak(threading.Thread):
    def __init__(self, r: Redis) -> None:
        super().__init__(daemon=True)
        self.r, self.stop, self.peak = r, threading.Event(), {"keys": 0, "used_memory": 0}

    def run(self) -> None:
        while not self.stop.wait(0.5):
            now = keys_and_memory(self.r)
            self.peak = {k: max(self.peak[k], now[k]) for k in now}


def job_run(rs: RedisServer, logs: Path, n_jobs: int) -> dict[str, Any]:
    r = rs.client()
    workers = [start_worker(rs.url, f"kw{i}", logs, backend__type="fake", backend__slots=16,
                            result_ttl=RESULT_TTL) for i in range(2)]
    try:
        time.sleep(3)
        idle = keys_and_memory(r)
        idle_names = sorted(str(as_str(k)) for k in r.keys("*"))
        fleet = Fleet(rs.url, result_ttl=RESULT_TTL)
        peak = Peak(r)
        peak.start()
        started = time.monotonic()
        jobs = [fleet.submit(prompt=f"job {i} says hello", max_tokens=4) for i in range(n_jobs)]
        results = [job.result(timeout=600) for job in jobs]
        elapsed = time.monotonic() - started
        peak.stop.set()
        peak.join()
        done = keys_and_memory(r)
        time.sleep(60)
        after = keys_and_memory(r)
        after_names = sorted(str(as_str(k)) for k in r.keys("*"))
        per_worker = {w: sum(res["worker"] == w for res in results) for w in ("kw0", "kw1")}
        return {
            "engine": "fake (no model): the bookkeeping per job is the same for every engine",
            "jobs": n_jobs, "result_ttl_s": RESULT_TTL, "seconds": round(elapsed, 1),
            "jobs_per_worker": per_worker,
            "idle_fleet": {**idle, "key_names": idle_names},
            "peak_during_run": peak.peak, "right_after_last_result": done,
            "after_60s_idle": {**after, "key_names": after_names},
            "extra_keys_after_idle": sorted(set(after_names) - set(idle_names)),
        }
    finally:
        for w in workers:
            w.stop()


def reap_with_a_million_keys(rs: RedisServer, logs: Path) -> dict[str, Any]:
    from worker.inprocess import fake_worker as inproc_worker
    from worker.liveness.heartbeat import Heartbeat
    from worker.liveness.reaper import Reaper

    r = rs.client()
    r.flushall()
    workers = [start_worker(rs.url, f"rw{i}", logs, backend__type="fake") for i in range(2)]
    try:
        slow = Redis.from_url(rs.url, socket_timeout=300)
        slow.execute_command("DEBUG", "POPULATE", 1_000_000, "unrelated")
        fleet = Fleet(rs.url, pool="reapme")
        for i in range(8):
            fleet.submit(prompt=f"held by a dead worker {i}")
        ghost = inproc_worker(rs.url, "ghost", pool="reapme", slots=8)
        assert len(ghost.claimer.claim(8)) == 8
        from rq.serializers import JSONSerializer
        from rq.worker import Worker

        beater = inproc_worker(rs.url, "beater", heartbeat_interval=1.0)
        rq_worker = Worker(queue_names("llm"), name="beater", connection=beater.redis,
                           serializer=JSONSerializer)
        rq_worker.register_birth()
        reaper = Reaper(r, "beater", 3, 60, queues=queue_names("reapme"))
        hb = Heartbeat(beater, rq_worker, reaper, {"name": "beater"})
        hb.beat()
        beat_times: list[float] = []
        original = hb.beat

        def timed_beat() -> None:
            original()
            beat_times.append(time.monotonic())

        hb.beat = timed_beat  # type: ignore[method-assign]
        hb.start()
        reap_times = []
        lowest = {name: 10**9 for name in ("beater", "rw0", "rw1")}
        until = time.monotonic() + 20
        while time.monotonic() < until:  # the heartbeat's own reaper thread reaps too
            t0 = time.perf_counter()
            r.delete("fleet:reaper:lock")
            reaper.reap()
            reap_times.append(time.perf_counter() - t0)
            for name in lowest:
                lowest[name] = min(lowest[name], int(r.pttl(worker_key(name))))
            time.sleep(0.2)
        hb.halt()
        hb.join(5)
        gaps = [b - a for a, b in itertools.pairwise(beat_times)]
        status = [json.loads(r.hget(worker_key(n), "jobs_requeued") or "0") for n in ("rw0", "rw1")]
        return {
            "unrelated_keys": 1_000_000, "dbsize": int(r.dbsize()), "reaps": len(reap_times),
            "reap_ms": {"min": round(min(reap_times) * 1000, 2), "max": round(max(reap_times) * 1000, 2),
                        "mean": round(sum(reap_times) / len(reap_times) * 1000, 2)},
            "dead_worker_jobs_requeued": int(r.llen("rq:queue:reapme:default")),
            "heartbeat_interval_s": 1.0, "beats": len(beat_times),
            "largest_beat_gap_s": round(max(gaps), 3) if gaps else None,
            "lowest_status_key_pttl_ms": lowest,
            "workers_jobs_requeued": status,
            "missed_beats": sum(g > 1.5 for g in gaps),
        }
    finally:
        for w in workers:
            w.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench-runs" / "reliability-keys.json"))
    args = ap.parse_args()
    debug = ["--enable-debug-command", "local"]
    with tempfile.TemporaryDirectory() as tmp, RedisServer.start(Path(tmp) / "redis", extra=debug) as rs:
        out = {"job_run": job_run(rs, Path(tmp) / "logs", args.jobs)}
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")  # kept if the second part fails
        out["reap"] = reap_with_a_million_keys(rs, Path(tmp) / "logs")
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
