"""What a worker records for operators, beside the job's own result (docs/observability.md):

- monotonic counters (HINCRBY) per pool and per worker name: tokens generated, prompt tokens,
  jobs by outcome, restarts by kind, reaped jobs, worker starts. They live in Redis, so a worker
  that restarts continues them and Prometheus never sees a counter go backwards;
- histogram buckets (HINCRBY on the bucket's field, HINCRBYFLOAT on the sum): queue wait, TTFT,
  job duration, per pool;
- a bounded history per job: params (prompt shortened), every attempt (worker, backend), the
  reason each one was restarted, the ending with its timings. TTL'd hash + capped index zsets.

The job facts are a hook (`Facts`, worker/hooks/__init__.py): they are queued on a pipeline the caller
already sends (the start's MULTI, a step's text pipeline, the ending's MULTI; after a requeue
script, which cannot carry them, one pipeline of their own), so observability adds no round
trips to the hot path. The worker setting
`observe: false` leaves the hook out (worker/assembly.py) and the per-beat counters off
(liveness, the status hash, stays).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from redis import Redis
from redis.client import Pipeline

from backends.contract import observe_schema
from backends.contract.keys import (
    HISTORY_RECENT,
    POOLS_SET,
    histogram_key,
    history_failed_key,
    history_key,
    pool_counters_key,
    worker_counters_key,
)
from backends.contract.observe_schema import pool_of, restart_kind

if TYPE_CHECKING:
    from worker.hooks import Holder, Restart
    from worker.job import ClaimedJob, Ending

Pipe = Pipeline | Redis
JOBS_SHOWN = 32  # jobs listed with their progress in a worker's status hash


class Facts:
    """The job facts as a hook: each write's facts on the pipeline that carries the write."""

    def on_start(self, job: ClaimedJob, holder: Holder, pipe: Pipeline) -> None:
        record_start(job, holder.worker, holder.backend, pipe)

    def on_restart(self, restart: Restart, pipe: Pipeline) -> None:
        record_restart(pipe, restart.job_id, restart.queue, restart.attempt, restart.reason, restart.by,
                       reaped=restart.reaped, requeued=restart.requeued)

    def on_end(self, job: ClaimedJob, ending: Ending, holder: Holder, pipe: Pipeline) -> None:
        record_end(job, ending, pipe, holder.worker, holder.backend, holder.result_ttl)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _count(pipe: Pipe, pool: str, worker: str | None, fields: dict[str, int]) -> None:
    keys = [pool_counters_key(pool)] + ([worker_counters_key(worker)] if worker else [])
    for key in keys:
        for field, n in fields.items():
            if n:
                pipe.hincrby(key, field, n)
    pipe.expire(pool_counters_key(pool), observe_schema.POOL_COUNTERS_TTL)
    if worker:
        pipe.expire(worker_counters_key(worker), observe_schema.WORKER_COUNTERS_TTL)


def _observe(pipe: Pipe, metric: str, pool: str, seconds: float) -> None:
    key = histogram_key(metric, pool)
    pipe.hincrby(key, observe_schema.bucket_field(metric, seconds), 1)
    pipe.hincrbyfloat(key, observe_schema.SUM_FIELD, round(max(seconds, 0.0), 6))
    pipe.expire(key, observe_schema.POOL_COUNTERS_TTL)


def _touch_history(pipe: Pipe, job_id: str, fields: dict[str, str], now: float,
                   ttl: int = observe_schema.HISTORY_TTL) -> None:
    key = history_key(job_id)
    mapping: dict[Any, Any] = {**fields, "updated_at": repr(round(now, 3))}
    pipe.hset(key, mapping=mapping)
    pipe.expire(key, ttl)
    pipe.zadd(HISTORY_RECENT, {job_id: now})
    pipe.zremrangebyrank(HISTORY_RECENT, 0, -observe_schema.HISTORY_CAP - 1)
    pipe.expire(HISTORY_RECENT, observe_schema.HISTORY_TTL)


def record_start(job: ClaimedJob, worker: str, backend: str, pipe: Pipe) -> None:
    """A job starts an attempt on this worker (queued on the pipeline that marks it started)."""
    fields = {"queue": job.queue, "state": "running", "attempts": str(job.attempt),
              f"attempt:{job.attempt}": _dumps({"worker": worker, "backend": backend,
                                                 "started_at": round(time.time(), 3)})}
    if job.request is not None:
        fields["params"] = _dumps(observe_schema.short_params(job.request))
    if job.enqueued_ms:
        fields["enqueued_at"] = repr(round(job.enqueued_ms / 1000, 3))
        if job.attempt == 1 and job.claimed_ms:  # a requeued job's wait would count earlier attempts
            _observe(pipe, "queue_wait", pool_of(job.queue), (job.claimed_ms - job.enqueued_ms) / 1000)
    _touch_history(pipe, job.id, fields, time.time())


def record_end(job: ClaimedJob, ending: Ending, pipe: Pipe, worker: str, backend: str,
               result_ttl: int) -> None:
    """A job's one final entry (queued inside the ending's MULTI: counted exactly once). A failed
    job's history stays for post-mortems (HISTORY_TTL, capped index); any other lives as long as
    its result, so a busy fleet's keys fall back to idle with its results."""
    now = time.time()
    pool = pool_of(job.queue)
    result = ending.result
    if result is None:
        outcome = "failed"
    else:
        outcome = "cancelled" if result.get("finish_reason") == "cancelled" else "finished"
    usage = (result or {}).get("usage") or {}
    ran_here = job.request is not None  # not a job failed before it ran (refused, or by the reaper)
    _count(pipe, pool, worker, {
        observe_schema.jobs_field(outcome): 1,
        observe_schema.TOKENS: int(job.completion_tokens),
        observe_schema.PROMPT_TOKENS: int(usage.get("prompt_tokens") or 0),
        observe_schema.CACHED_TOKENS: int(usage.get("cached_tokens") or 0),
        **_restored(timings := dict((result or {}).get("timings") or {})),
    })
    if ran_here:
        total = time.monotonic() - job.claimed_at  # claimed_at, first_token_at: monotonic
        _observe(pipe, "job_duration", pool, total)
        timings.setdefault("total_ms", round(total * 1000, 1))
        if job.first_token_at is not None:
            _observe(pipe, "ttft", pool, job.first_token_at - job.claimed_at)
            timings.setdefault("ttft_ms", round((job.first_token_at - job.claimed_at) * 1000, 1))
        if job.enqueued_ms and job.claimed_ms:  # Redis server time, both
            timings.setdefault("queue_ms", float(job.claimed_ms - job.enqueued_ms))
    end = {"outcome": outcome, "worker": worker, "backend": (result or {}).get("backend", backend),
           "attempt": job.attempt, "ended_at": round(now, 3), "timings": timings,
           "finish_reason": (result or {}).get("finish_reason"), "usage": usage,
           "completion_tokens": job.completion_tokens, "error": ending.error}
    ttl = observe_schema.HISTORY_TTL if outcome == "failed" else min(result_ttl, observe_schema.HISTORY_TTL)
    _touch_history(pipe, job.id, {"queue": job.queue, "state": outcome, "end": _dumps(end)}, now, ttl)
    if outcome == "failed":
        failed = history_failed_key(job.queue)
        pipe.zadd(failed, {job.id: now})
        pipe.zremrangebyrank(failed, 0, -observe_schema.HISTORY_CAP - 1)
        pipe.expire(failed, observe_schema.HISTORY_TTL)


def _restored(timings: dict[str, Any]) -> dict[str, int]:
    """The job's KV read from the host's KV store, as counters (none: nothing)."""
    tokens, ms = timings.get("kv_restored_tokens"), timings.get("kv_restored_ms")
    if not isinstance(tokens, int) or not isinstance(ms, int | float) or tokens <= 0:
        return {}
    return {observe_schema.STORE_RESTORES: 1, observe_schema.STORE_RESTORED_TOKENS: tokens,
            observe_schema.STORE_RESTORE_MS: round(ms)}


def record_restart(pipe: Pipe, job_id: str, queue: str, attempt: int, reason: str, by: str,
                   *, reaped: bool = False, requeued: bool = True) -> None:
    """Attempt `attempt` of a job ended without a result: `reason` goes into its history, and the
    job goes round again (`requeued`) or, when the reaper gives up, has failed already."""
    now = time.time()
    kind = restart_kind(reason)
    fields = {observe_schema.restarts_field(kind): 1 if requeued else 0,
              observe_schema.REAPED: 1 if reaped else 0}
    # counted against the pool only: the worker that held it may be dead (its name is in the reason)
    _count(pipe, pool_of(queue), None, fields)
    entry = {"reason": reason, "kind": kind, "at": round(now, 3), "by": by}
    history = {"queue": queue, f"restart:{attempt}": _dumps(entry)}
    if requeued:
        history["state"] = "queued"
    _touch_history(pipe, job_id, history, now)


class LiveFacts:
    """Per-beat additions to the worker's status hash, and the per-beat counter upkeep (`counting`:
    the `observe` setting). Used by the heartbeat thread only."""

    def __init__(self, pool: str, name: str, *, counting: bool = True) -> None:
        self.pool = pool
        self.name = name
        self.counting = counting
        self._prefill: tuple[float, int] | None = None  # (monotonic time, engine prefill count)
        self._started = False

    def status_fields(self, stats: dict[str, Any], inflight: Iterable[ClaimedJob],
                      engine_down: bool) -> dict[str, Any]:
        """`stats`: the backend's; `inflight`: a copy of the loop's jobs; `engine_down`: claims
        are paused after an engine failure."""
        now = time.monotonic()  # ClaimedJob.claimed_at is monotonic
        jobs = [{"id": j.id, "tokens": j.completion_tokens,
                 "max_tokens": getattr(j.request, "max_tokens", None),
                 "attempt": j.attempt, "age_s": round(now - j.claimed_at, 1)}
                for j in list(inflight)[:JOBS_SHOWN] if j.ending is None]
        return {"tok_s_prefill": self._prefill_rate(stats),
                "backend_health": backend_health(stats, engine_down), "jobs": jobs}

    def _prefill_rate(self, stats: dict[str, Any]) -> float | None:
        count = stats.get("prompt_tokens_prefilled")
        if not isinstance(count, int):
            return None  # HTTP engines do not report their prefill
        now = time.monotonic()
        before, self._prefill = self._prefill, (now, count)
        if before is None or now <= before[0]:
            return 0.0
        return round(max(count - before[1], 0) / (now - before[0]), 1)

    def on_beat(self, pipe: Pipe) -> None:
        pipe.sadd(POOLS_SET, self.pool)
        pipe.expire(POOLS_SET, observe_schema.POOL_COUNTERS_TTL)
        if not self.counting:
            return
        if not self._started:  # once per process: restarts show as starts > 1 for a name
            self._started = True
            _count(pipe, self.pool, self.name, {observe_schema.STARTS: 1})
        pipe.expire(worker_counters_key(self.name), observe_schema.WORKER_COUNTERS_TTL)


def backend_health(stats: dict[str, Any], engine_down: bool) -> str:
    """ok; degraded (a fallback chain serves from a backup); down (the engine failed, claims paused)."""
    if engine_down:
        return "down"
    members = stats.get("members")
    if isinstance(members, list) and members:
        if not any(isinstance(m, dict) and m.get("healthy") for m in members):
            return "down"
        first = members[0]
        if isinstance(first, dict) and not first.get("healthy"):
            return "degraded"
    return "ok"

