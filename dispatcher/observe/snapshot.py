"""One read of the fleet for `fleet status`, the metrics exporter and the dashboard: live workers
(their status hashes), queues (depth, oldest job's age, running, failed in the last hour), the
pool's monotonic counters and totals. Two pipelined round trips plus one per worker set."""

from __future__ import annotations

import json
import time
from typing import Any

from redis import Redis

from backends.contract.keys import (
    POOLS_SET,
    WORKERS_SET,
    failed_registry_key,
    finished_registry_key,
    history_failed_key,
    job_key,
    pool_counters_key,
    queue_key,
    queue_name,
    started_registry_key,
    worker_counters_key,
    worker_key,
)
from backends.contract.replies import as_str
from backends.contract.schema import PRIORITIES
from dispatcher.observe import schema

FAILED_WINDOW = 3600.0  # "failed in the last hour"


def _decode_status(raw: dict[Any, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in raw.items():
        try:
            out[as_str(k) or ""] = json.loads(v)
        except (ValueError, TypeError):
            out[as_str(k) or ""] = as_str(v)
    return out


def _counters(raw: dict[Any, Any]) -> dict[str, int]:
    return {as_str(k) or "": int(v) for k, v in raw.items()}


def workers(redis: Redis, with_counters: bool = False, include_dead: bool = False) -> list[dict[str, Any]]:
    """Live workers (status hash present, "up": true), sorted by name; `with_counters` adds each
    name's monotonic counters under "counters". Registered names whose hash expired (dead, not
    yet reaped) are left out, or listed as {"name", "up": false} with `include_dead`."""
    names = sorted(as_str(n) or "" for n in redis.smembers(WORKERS_SET))
    if not names:
        return []
    with redis.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hgetall(worker_key(name))
            if with_counters:
                pipe.hgetall(worker_counters_key(name))
        replies = pipe.execute()
    step = 2 if with_counters else 1
    out = []
    for i, name in enumerate(names):
        raw = replies[i * step]
        if not raw:  # registered but dead: the reaper will collect it
            if include_dead:
                out.append({"name": name, "up": False})
            continue
        w = _decode_status(raw)
        w.setdefault("name", name)
        w["up"] = True
        if with_counters:
            w["counters"] = _counters(replies[i * step + 1])
        out.append(w)
    return out


def pools(redis: Redis, default: str) -> list[str]:
    return sorted({default, *(as_str(p) or "" for p in redis.smembers(POOLS_SET))} - {""})


def queues(redis: Redis, pool: str, now: float | None = None) -> list[dict[str, Any]]:
    now = time.time() if now is None else now
    with redis.pipeline(transaction=False) as pipe:
        for p in PRIORITIES:
            name = queue_name(pool, p)
            pipe.llen(queue_key(name))
            pipe.lindex(queue_key(name), 0)  # claims pop the head: it is the oldest waiting job
            pipe.zcard(started_registry_key(name))
            pipe.zcount(history_failed_key(name), now - FAILED_WINDOW, "+inf")
            pipe.zcard(finished_registry_key(name))
            pipe.zcard(failed_registry_key(name))
        replies = pipe.execute()
    rows = []
    heads: list[str] = []
    for i, p in enumerate(PRIORITIES):
        depth, head, running, failed_1h, finished, failed = replies[6 * i: 6 * i + 6]
        heads.append(as_str(head) or "")
        rows.append({"queue": queue_name(pool, p), "priority": p, "depth": depth, "running": running,
                     "started": running,  # RQ's word for it (older `fleet status --json` readers)
                     "failed_1h": failed_1h, "finished": finished, "failed": failed,
                     "oldest_age_s": None})
    if any(heads):
        with redis.pipeline(transaction=False) as pipe:
            for head in heads:
                pipe.hget(job_key(head), "enqueued_at")
            enqueued = pipe.execute()
        for row, at in zip(rows, enqueued, strict=True):
            row["oldest_age_s"] = _age(as_str(at), now)
    return rows


def _age(rq_time: str | None, now: float) -> float | None:
    """RQ stores enqueued_at as an ISO UTC timestamp."""
    if not rq_time:
        return None
    from rq.utils import utcparse

    try:
        return round(max(now - utcparse(rq_time).timestamp(), 0.0), 1)
    except ValueError:
        return None


def pool_counters(redis: Redis, pool: str) -> dict[str, int]:
    return _counters(redis.hgetall(pool_counters_key(pool)))


def snapshot(redis: Redis, pool: str, with_counters: bool = False) -> dict[str, Any]:
    """Everything `fleet status` shows (JSON-ready)."""
    now = time.time()
    ws = [w for w in workers(redis, with_counters) if w.get("pool", pool) == pool]
    qs = queues(redis, pool, now)
    counters = pool_counters(redis, pool)
    return {"pool": pool, "at": round(now, 3), "workers": ws, "queues": qs,
            "totals": totals(ws, qs, counters), "counters": counters}


def totals(ws: list[dict[str, Any]], qs: list[dict[str, Any]], counters: dict[str, int]) -> dict[str, Any]:
    return {
        "workers": len(ws),
        "slots": sum(int(w.get("slots") or 0) for w in ws),
        "busy": sum(int(w.get("inflight") or 0) for w in ws),
        "tok_s": round(sum(float(w.get("tok_s") or 0) for w in ws), 1),
        "tok_s_prefill": round(sum(float(w.get("tok_s_prefill") or 0) for w in ws), 1),
        "queued": sum(q["depth"] for q in qs),
        "running": sum(q["running"] for q in qs),
        "failed_1h": sum(q["failed_1h"] for q in qs),
        "tokens_generated": counters.get(schema.TOKENS, 0),
        "prompt_tokens": counters.get(schema.PROMPT_TOKENS, 0),
        "jobs": {o: counters.get(schema.jobs_field(o), 0) for o in schema.OUTCOMES},
    }
