"""Shared by the multi-host tests (partition, Sentinel failover): workers as processes in network
namespaces, a job-volume generator, and checks on what 300 jobs left in Redis."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis import Redis

from backends.contract.keys import history_key, inflight_key, job_key, queue_names, worker_key
from dispatcher import Fleet, FleetJob
from tests.harness import ROOT, WorkerProcess, wait_for, worker_env
from tests.netns import NetLab
from tests.reliability_checks import stream_events

# fake backend for job volume (the engine is not what these tests exercise): one word per
# 50 ms step, so a 40-word job takes ~2 s, like a short real generation
FAKE_WORKER = {"backend__type": "fake", "backend__slots": 8, "backend__step_delay": 0.05}
WORDS_PER_JOB = 40


def prompt(i: int) -> str:
    return " ".join(f"j{i}w{k}" for k in range(WORDS_PER_JOB))


def start_worker_in(lab: NetLab | None, host: str | None, redis_url: str, name: str, log_dir: Path,
                    watch: Redis, engine: dict[str, Any] | None = None, timeout: float = 60,
                    **settings: Any) -> WorkerProcess:
    """`fleet worker` inside a lab host's namespace (lab None: in this namespace); `engine`: its
    backend settings (default: the fake engine, FAKE_WORKER)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    argv = [sys.executable, "-m", "ecosystem.cli", "worker"]
    env = worker_env(redis_url, name, **{**(FAKE_WORKER if engine is None else engine), **settings})
    out = log.open("wb")
    if lab is not None and host is not None:
        proc = lab.popen(host, argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    else:
        proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    w = WorkerProcess(name, proc, log)

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"worker {name} exited ({proc.returncode}):\n{w.output()[-3000:]}")
        return bool(watch.exists(worker_key(name)))

    wait_for(up, timeout, f"worker {name} to register")
    return w


@dataclass
class Timeline:
    """Named moments (seconds since `t0`), printed and kept in the test's JSON."""

    t0: float = field(default_factory=time.monotonic)
    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str, at: float | None = None) -> float:
        self.marks[name] = round((at if at is not None else time.monotonic()) - self.t0, 2)
        return self.marks[name]

    def when(self, name: str, pred: Callable[[], Any], timeout: float) -> float:
        wait_for(pred, timeout, name, interval=0.05)
        return self.mark(name)

    def dump(self, path: Path, **extra: Any) -> dict[str, Any]:
        record = {"timeline_s": self.marks, **extra}
        path.write_text(json.dumps(record, indent=2))
        print("\n" + json.dumps(record, indent=2))
        return record


def final_counts(redis: Redis, job_ids: list[str]) -> dict[str, int]:
    """Final stream entries per job (1 = ended exactly once)."""
    return {j: sum(1 for ev in stream_events(redis, j) if ev.final) for j in job_ids}


def ended(redis: Redis, job_ids: list[str]) -> int:
    return sum(1 for n in final_counts(redis, job_ids).values() if n)


def late_text(redis: Redis, job_ids: list[str]) -> dict[str, list[tuple[int, int]]]:
    """Per job, text entries of an attempt stored after a higher attempt had begun: text from a
    fenced (taken-over) attempt written after the new attempt's restart marker."""
    late: dict[str, list[tuple[int, int]]] = {}
    for job_id in job_ids:
        highest = 0
        for ev in stream_events(redis, job_id):
            if ev.kind == "text" and ev.attempt < highest:
                late.setdefault(job_id, []).append((ev.attempt, highest))
            highest = max(highest, ev.attempt)
    return late


def submit_all(fleet: Fleet, n: int) -> list[FleetJob]:
    return [fleet.submit(prompt(i), max_tokens=WORDS_PER_JOB, temperature=0) for i in range(n)]


def results_by_worker(redis: Redis, job_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for job_id in job_ids:
        for ev in stream_events(redis, job_id):
            if ev.kind == "done" and ev.data:
                out.setdefault(str(ev.data.get("worker")), []).append(ev.data)
    return out


def whereabouts(redis: Redis, job_ids: list[str], workers: list[str], pool: str = "default") -> str:
    """Where each job without a final entry is (queues, in-flight lists, its hash and history):
    what a timeout in a multi-host test prints, so one failure is enough to see what went wrong."""
    lists = {q: redis.lrange(f"rq:queue:{q}", 0, -1) for q in queue_names(pool)}
    lists |= {f"in-flight {w}": redis.lrange(inflight_key(w), 0, -1) for w in workers}
    lines = []
    for job_id, n in final_counts(redis, job_ids).items():
        if n:
            continue
        where = [name for name, ids in lists.items() if job_id.encode() in ids] or ["no list"]
        fields = redis.hmget(job_key(job_id), ["status", "fleet_owner", "fleet_attempt", "fleet_final"])
        kinds = [ev.kind for ev in stream_events(redis, job_id)]
        history = {k.decode(): v.decode()[:200] for k, v in redis.hgetall(history_key(job_id)).items()}
        lines.append(f"{job_id}: in {where}; hash {fields}; stream {kinds}; history {history}")
    return "\n".join(lines)
