"""Reading job history for `fleet jobs`, `fleet job ID` and the dashboard.

The worker writes fleet:history:<id> (worker/facts.py); jobs still waiting have none yet, so
queued jobs are read from their queue and RQ's job hash."""

from __future__ import annotations

import heapq
import json
import time
from typing import Any

from redis import Redis
from redis.exceptions import ResponseError
from rq.job import Job
from rq.serializers import JSONSerializer

from backends.contract.keys import (
    HISTORY_RECENT,
    WORKERS_SET,
    history_failed_key,
    history_key,
    inflight_key,
    job_key,
    queue_key,
    queue_name,
)
from backends.contract.replies import as_str
from backends.contract.schema import PRIORITIES
from dispatcher.observe import schema

KINDS = ("recent", "failed", "running", "queued")


def _load(raw: Any) -> Any:
    try:
        return json.loads(raw)
    except (TypeError, ValueError):
        return as_str(raw)


def decode(job_id: str, raw: dict[Any, Any]) -> dict[str, Any]:
    """A history hash as one JSON-ready record: attempts in order, each with the reason it was lost."""
    fields = {as_str(k) or "": v for k, v in raw.items()}
    attempts: dict[int, dict[str, Any]] = {}
    for name, value in fields.items():
        kind, _, n = name.partition(":")
        if kind in ("attempt", "restart") and n.isdigit():
            entry = attempts.setdefault(int(n), {"attempt": int(n)})
            data = _load(value)
            if kind == "attempt" and isinstance(data, dict):
                entry.update(data)
            elif isinstance(data, dict):
                entry["lost"] = data  # why this attempt ended without a result
    end = _load(fields["end"]) if "end" in fields else None
    return {
        "id": job_id,
        "queue": as_str(fields.get("queue")),
        "state": as_str(fields.get("state")),
        "params": _load(fields["params"]) if "params" in fields else None,
        "enqueued_at": _float(fields.get("enqueued_at")),
        "updated_at": _float(fields.get("updated_at")),
        "attempts": [attempts[n] for n in sorted(attempts)],
        "end": end,
    }


def _float(raw: Any) -> float | None:
    try:
        return float(raw) if raw is not None else None
    except (TypeError, ValueError):
        return None


def get(redis: Redis, job_id: str) -> dict[str, Any] | None:
    """One job: its history, or (queued, or written by a worker with `observe` off) what RQ knows."""
    try:
        raw = redis.hgetall(history_key(job_id))
    except ResponseError:  # not a job's hash (an index shares the prefix): no such job
        return None
    if raw:
        return decode(job_id, raw)
    return from_rq(redis, job_id)


def resolve(redis: Redis, prefix: str) -> str:
    """A job id from the short ids the tables print: the one recent job starting with `prefix`
    (the prefix itself when none or several do)."""
    if len(prefix) < 6 or redis.exists(history_key(prefix)) or redis.exists(job_key(prefix)):
        return prefix
    matches = [i for x in redis.zrange(HISTORY_RECENT, 0, -1) if (i := as_str(x) or "").startswith(prefix)]
    return matches[0] if len(matches) == 1 else prefix


def from_rq(redis: Redis, job_id: str) -> dict[str, Any] | None:
    try:
        fields, status = redis.hlen(job_key(job_id)), as_str(redis.hget(job_key(job_id), "status"))
    except ResponseError:  # not a hash
        return None
    if fields == 0 or (fields == 1 and status == "canceled"):
        return None  # unknown, or a cancelled batch line's tombstone (the batch records the line)
    try:
        job = Job.fetch(job_id, connection=redis, serializer=JSONSerializer)
    except Exception as e:  # unreadable: still say what is there
        return {"id": job_id, "state": "unreadable", "end": {"error": f"{type(e).__name__}: {e}"[:300]},
                "attempts": [], "params": None, "queue": None}
    params = job.args[0] if isinstance(job.args, list | tuple) and job.args else None
    if isinstance(params, dict):
        params = schema.short_params(params)
    status = job.get_status(refresh=False)
    result = job.latest_result() if status == "failed" else None
    exc = result.exc_string if result is not None else None
    return {"id": job_id, "queue": job.origin, "state": str(status or "queued"),
            "params": params, "enqueued_at": job.enqueued_at.timestamp() if job.enqueued_at else None,
            "updated_at": None, "attempts": [], "end": {"error": exc} if exc else None}


def _records(redis: Redis, ids: list[str]) -> list[dict[str, Any]]:
    with redis.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hgetall(history_key(job_id))
        replies = pipe.execute()
    out = []
    for job_id, raw in zip(ids, replies, strict=True):
        if raw:
            out.append(decode(job_id, raw))
        else:  # history expired (or never written): RQ may still know it
            record = from_rq(redis, job_id)
            if record is not None:
                out.append(record)
    return out


def listing(redis: Redis, pool: str, kind: str = "recent", limit: int = 20) -> list[dict[str, Any]]:
    """Newest first. recent: any job a worker touched; failed: the pool's failed jobs;
    running: held by a worker now; queued: waiting, next to run first."""
    if kind not in KINDS:
        raise ValueError(f"unknown job listing {kind!r}; one of {', '.join(KINDS)}")
    limit = max(1, min(limit, 1000))
    if kind == "recent":
        ids = [as_str(x) or "" for x in redis.zrevrange(HISTORY_RECENT, 0, limit * 3)]
        records = [r for r in _records(redis, ids) if schema.pool_of(r.get("queue") or pool) == pool]
        return records[:limit]
    if kind == "failed":
        per_queue = []
        for p in PRIORITIES:
            pairs: list[tuple[bytes, float]] = redis.zrevrange(  # type: ignore[assignment]
                history_failed_key(queue_name(pool, p)), 0, limit - 1, withscores=True)
            per_queue.append([(-score, as_str(m) or "") for m, score in pairs])
        ids = [job_id for _, job_id in heapq.merge(*per_queue)][:limit]
        return _records(redis, ids)
    if kind == "running":
        names = [as_str(n) or "" for n in redis.smembers(WORKERS_SET)]
        with redis.pipeline(transaction=False) as pipe:
            for name in sorted(names):
                pipe.lrange(inflight_key(name), 0, -1)
            held = pipe.execute()
        ids = [as_str(x) or "" for ids_ in held for x in ids_]
        records = [r for r in _records(redis, ids) if schema.pool_of(r.get("queue") or pool) == pool]
        records.sort(key=lambda r: -(r.get("updated_at") or 0))
        return records[:limit]
    ids = []
    for p in PRIORITIES:
        ids += [as_str(x) or "" for x in redis.lrange(queue_key(queue_name(pool, p)), 0, limit - 1)]
    return [r for job_id in ids[:limit] if (r := from_rq(redis, job_id)) is not None]


def age(record: dict[str, Any], now: float | None = None) -> float | None:
    at = record.get("enqueued_at")
    return None if at is None else round((now or time.time()) - at, 1)
