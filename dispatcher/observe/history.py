"""Reading job history for `fleet jobs`, `fleet job ID` and the dashboard.

The worker writes fleet:history:<id> (worker/hooks/facts.py); jobs still waiting have none yet, so
queued jobs are read from their queue and RQ's job hash. Each read is a plan (dispatcher/plans.py):
the functions without `_plan` run it on a sync client (`fleet jobs`), the gateway's dashboard runs
the plans on its async client."""

from __future__ import annotations

import heapq
import json
import time
from typing import Any

from redis import Redis
from redis.exceptions import ResponseError
from rq.exceptions import NoSuchJobError
from rq.job import Job, parse_job_id
from rq.results import Result
from rq.serializers import JSONSerializer

from backends.contract import observe_schema
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
from dispatcher.plans import Plan, ask, cmd, gather, run
from dispatcher.rules import RQ_OFFLINE

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
    return run(redis, get_plan(job_id))


def get_plan(job_id: str) -> Plan[dict[str, Any] | None]:
    """One job: its history, or (queued, or written by a worker with `observe` off) what RQ knows."""
    try:
        raw = yield from ask(cmd("hgetall", history_key(job_id)))
    except ResponseError:  # not a job's hash (an index shares the prefix): no such job
        return None
    if raw:
        return decode(job_id, raw)
    return (yield from from_rq_plan(job_id))


def resolve(redis: Redis, prefix: str) -> str:
    return run(redis, resolve_plan(prefix))


def resolve_plan(prefix: str) -> Plan[str]:
    """A job id from the short ids the tables print: the one recent job starting with `prefix`
    (the prefix itself when none or several do)."""
    if len(prefix) < 6:
        return prefix
    known = yield from gather([cmd("exists", history_key(prefix)), cmd("exists", job_key(prefix))])
    if any(known):
        return prefix
    recent = yield from ask(cmd("zrange", HISTORY_RECENT, 0, -1))
    matches = [i for x in recent if (i := as_str(x) or "").startswith(prefix)]
    return matches[0] if len(matches) == 1 else prefix


def from_rq_plan(job_id: str) -> Plan[dict[str, Any] | None]:
    """What RQ's job hash says of a job, decoded by RQ's own Job (and its latest Result when the
    job failed)."""
    key = job_key(job_id)
    try:
        fields, status, raw = yield from gather([cmd("hlen", key), cmd("hget", key, "status"),
                                                 cmd("hgetall", job_key(parse_job_id(job_id)))])
    except ResponseError:  # not a hash
        return None
    if fields == 0 or (fields == 1 and as_str(status) == "canceled"):
        return None  # unknown, or a cancelled batch line's tombstone (the batch records the line)
    try:
        job = Job(parse_job_id(job_id), connection=RQ_OFFLINE, serializer=JSONSerializer)
        if not raw:
            raise NoSuchJobError(f"No such job: {job.key!r}")
        job.restore(raw)
    except Exception as e:  # unreadable: still say what is there
        return {"id": job_id, "state": "unreadable", "end": {"error": f"{type(e).__name__}: {e}"[:300]},
                "attempts": [], "params": None, "queue": None}
    params = job.args[0] if isinstance(job.args, list | tuple) and job.args else None
    if isinstance(params, dict):
        params = observe_schema.short_params(params)
    rq_status = job.get_status(refresh=False)
    exc = None
    if rq_status == "failed":
        latest = yield from ask(cmd("xrevrange", Result.get_key(job.id), "+", "-", count=1))
        if latest:
            result_id, payload = latest[0]
            exc = Result.restore(job.id, as_str(result_id) or "", payload, connection=RQ_OFFLINE,
                                 serializer=JSONSerializer).exc_string
    return {"id": job_id, "queue": job.origin, "state": str(rq_status or "queued"),
            "params": params, "enqueued_at": job.enqueued_at.timestamp() if job.enqueued_at else None,
            "updated_at": None, "attempts": [], "end": {"error": exc} if exc else None}


def _records_plan(ids: list[str]) -> Plan[list[dict[str, Any]]]:
    replies = yield from gather([cmd("hgetall", history_key(job_id)) for job_id in ids])
    out = []
    for job_id, raw in zip(ids, replies, strict=True):
        if raw:
            out.append(decode(job_id, raw))
        else:  # history expired (or never written): RQ may still know it
            record = yield from from_rq_plan(job_id)
            if record is not None:
                out.append(record)
    return out


def listing(redis: Redis, pool: str, kind: str = "recent", limit: int = 20) -> list[dict[str, Any]]:
    return run(redis, listing_plan(pool, kind, limit))


def listing_plan(pool: str, kind: str = "recent", limit: int = 20) -> Plan[list[dict[str, Any]]]:
    """Newest first. recent: any job a worker touched; failed: the pool's failed jobs;
    running: held by a worker now; queued: waiting, next to run first."""
    if kind not in KINDS:
        raise ValueError(f"unknown job listing {kind!r}; one of {', '.join(KINDS)}")
    limit = max(1, min(limit, 1000))
    if kind == "recent":
        ids = [as_str(x) or "" for x in (yield from ask(cmd("zrevrange", HISTORY_RECENT, 0, limit * 3)))]
        return _in_pool((yield from _records_plan(ids)), pool)[:limit]
    if kind == "failed":
        failed = yield from gather([cmd("zrevrange", history_failed_key(queue_name(pool, p)), 0, limit - 1,
                                        withscores=True) for p in PRIORITIES])
        per_queue = [[(-score, as_str(m) or "") for m, score in pairs] for pairs in failed]
        ids = [job_id for _, job_id in heapq.merge(*per_queue)][:limit]
        return (yield from _records_plan(ids))
    if kind == "running":
        names = sorted(as_str(n) or "" for n in (yield from ask(cmd("smembers", WORKERS_SET))))
        held = yield from gather([cmd("lrange", inflight_key(name), 0, -1) for name in names])
        ids = [as_str(x) or "" for ids_ in held for x in ids_]
        records = _in_pool((yield from _records_plan(ids)), pool)
        records.sort(key=lambda r: -(r.get("updated_at") or 0))
        return records[:limit]
    queued = yield from gather([cmd("lrange", queue_key(queue_name(pool, p)), 0, limit - 1)
                                for p in PRIORITIES])
    ids = [as_str(x) or "" for ids_ in queued for x in ids_][:limit]
    out = []
    for job_id in ids:
        record = yield from from_rq_plan(job_id)
        if record is not None:
            out.append(record)
    return out


def _in_pool(records: list[dict[str, Any]], pool: str) -> list[dict[str, Any]]:
    return [r for r in records if observe_schema.pool_of(r.get("queue") or pool) == pool]


def age(record: dict[str, Any], now: float | None = None) -> float | None:
    at = record.get("enqueued_at")
    return None if at is None else round((now or time.time()) - at, 1)
