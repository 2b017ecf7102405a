"""Soak: many short jobs through one real worker; does it leak memory, slots or KV cells?

Starts a private redis-server and one `fleet worker` (the real model unless --backend fake),
keeps --concurrency jobs in flight until --jobs have finished, and reports:
  - the worker's RSS after --warmup jobs and at the end (growth %, limit --max-growth),
  - RSS every --sample-every jobs,
  - what the worker holds once idle: in-flight jobs, engine slots (active, waiting) and KV cells
    reserved (the worker's own status hash, backend_stats), which must all be 0,
  - failures, throughput.
Writes the same as JSON (--json). Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import psutil

from backends.contract.keys import inflight_key, queue_key, queue_names, worker_key
from dispatcher import Fleet, FleetJob, JobFailed
from ecosystem.local.processes import RedisServer, start_worker

TOPICS = ["rain", "bread", "stars", "rivers", "clocks", "salt", "wolves", "paper"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200, help="jobs before the RSS baseline")
    p.add_argument("--concurrency", type=int, default=32, help="jobs kept in flight by the producer")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--backend", default="llama-cpp", choices=["llama-cpp", "fake"])
    p.add_argument("--sample-every", type=int, default=100)
    p.add_argument("--max-growth", type=float, default=5.0, help="allowed RSS growth after warm-up, %%")
    p.add_argument("--json", type=Path, default=Path("bench-results/soak.json"))
    return p.parse_args()


def submit(fleet: Fleet, i: int, max_tokens: int) -> FleetJob:
    topic = TOPICS[i % len(TOPICS)]
    return fleet.submit(prompt=f"Soak job {i}: one short line about {topic}:", max_tokens=max_tokens,
                        temperature=0.7, seed=i)


def worker_status(redis: Any, name: str) -> dict[str, Any]:
    return {k.decode(): json.loads(v) for k, v in redis.hgetall(worker_key(name)).items()}


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    with RedisServer.start(workdir / "redis") as server:
        redis = server.client()
        worker = start_worker(server.url, "soak-1", workdir / "logs", backend__type=args.backend,
                              backend__slots=args.slots)
        try:
            proc = psutil.Process(worker.process.pid)
            fleet = Fleet(server.url)
            window: deque[FleetJob] = deque()
            submitted = finished = failed = 0
            samples: list[dict[str, float]] = []
            baseline: float | None = None
            started = time.monotonic()
            while finished + failed < args.jobs:
                if len(window) < args.concurrency and submitted < args.jobs:
                    window.append(submit(fleet, submitted, args.max_tokens))
                    submitted += 1
                    continue
                try:
                    window.popleft().result(timeout=300)
                    finished += 1
                except JobFailed as e:
                    failed += 1
                    print(f"job failed: {e.error}", file=sys.stderr)
                done = finished + failed
                if done == args.warmup:
                    baseline = proc.memory_info().rss / 2**20
                if done % args.sample_every == 0:
                    rss = proc.memory_info().rss / 2**20
                    samples.append({"jobs": done, "rss_mb": round(rss, 1),
                                    "seconds": round(time.monotonic() - started, 1)})
                    print(f"{done:5d} jobs  RSS {rss:7.1f} MiB  {samples[-1]['seconds']:6.1f}s", flush=True)
            elapsed = time.monotonic() - started
            end_rss = proc.memory_info().rss / 2**20
            time.sleep(2.5)  # two heartbeats: the status hash shows the idle engine
            status = worker_status(redis, "soak-1")
            stats = status.get("backend_stats", {})
            held = {
                "inflight_jobs": status.get("inflight"),
                "inflight_list": redis.llen(inflight_key("soak-1")),
                "queued": sum(redis.llen(queue_key(q)) for q in queue_names("llm")),
                "engine_active": stats.get("active"),
                "engine_waiting": stats.get("waiting"),
                "kv_cells_reserved": stats.get("kv_reserved"),
            }
            alive = worker.alive()
        finally:
            worker.stop()
    base = baseline or end_rss
    return {
        "jobs": args.jobs, "finished": finished, "failed": failed, "backend": args.backend,
        "slots": args.slots, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
        "seconds": round(elapsed, 1), "jobs_per_s": round(args.jobs / elapsed, 2),
        "rss_after_warmup_mb": round(base, 1), "rss_end_mb": round(end_rss, 1),
        "rss_growth_pct": round((end_rss - base) / base * 100, 2), "warmup_jobs": args.warmup,
        "samples": samples, "held_when_idle": held, "kv_cells": stats.get("kv_cells"),
        "worker_alive": alive, "backend_stats": stats,
    }


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="fleet-soak-") as tmp:
        report = run(args, Path(tmp))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    held = report["held_when_idle"]
    checks = {
        f"all {args.jobs} jobs finished": report["finished"] == args.jobs,
        f"RSS growth after warm-up < {args.max_growth}%": report["rss_growth_pct"] < args.max_growth,
        # None: the engine does not report it (the fake one has no KV cache)
        "nothing held once idle (jobs, slots, KV cells)": all(v in (0, None) for v in held.values()),
        "worker alive": report["worker_alive"],
    }
    print(f"\n{report['finished']}/{args.jobs} jobs in {report['seconds']}s ({report['jobs_per_s']} jobs/s), "
          f"{report['failed']} failed")
    print(f"RSS after {args.warmup} jobs: {report['rss_after_warmup_mb']} MiB; at the end: "
          f"{report['rss_end_mb']} MiB; growth {report['rss_growth_pct']:+.2f}%")
    print(f"idle worker holds: {held} (KV cells in the context: {report['kv_cells']})")
    for what, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {what}")
    print(f"written: {args.json}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
