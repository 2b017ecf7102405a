"""One read of the fleet for `fleet status`, the metrics exporter and the dashboard: live workers
(their status hashes), queues (depth, oldest job's age, running, failed in the last hour), the
pool's monotonic counters and totals. Two pipelined round trips plus one per worker set.

Each read is a plan (dispatcher/plans.py): the functions without `_plan` run it on a sync client
(`fleet status`), the gateway runs the plans on its async client."""

from __future__ import annotations

import json
import time
from typing import Any

from redis import Redis

from backends.contract import observe_schema
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
from dispatcher.plans import Plan, ask, cmd, gather, run

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
    return run(redis, workers_plan(with_counters, include_dead))


def workers_plan(with_counters: bool = False, include_dead: bool = False) -> Plan[list[dict[str, Any]]]:
    """Live workers (status hash present, "up": true), sorted by name; `with_counters` adds each
    name's monotonic counters under "counters". Registered names whose hash expired (dead, not
    yet reaped) are left out, or listed as {"name", "up": false} with `include_dead`."""
    names = sorted(as_str(n) or "" for n in (yield from ask(cmd("smembers", WORKERS_SET))))
    if not names:
        return []
    calls = []
    for name in names:
        calls.append(cmd("hgetall", worker_key(name)))
        if with_counters:
            calls.append(cmd("hgetall", worker_counters_key(name)))
    replies = yield from gather(calls)
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


def pools_plan(default: str) -> Plan[list[str]]:
    members = yield from ask(cmd("smembers", POOLS_SET))
    return sorted({default, *(as_str(p) or "" for p in members)} - {""})


def queues_plan(pool: str, now: float | None = None) -> Plan[list[dict[str, Any]]]:
    now = time.time() if now is None else now
    calls = []
    for p in PRIORITIES:
        name = queue_name(pool, p)
        calls += [cmd("llen", queue_key(name)),
                  cmd("lindex", queue_key(name), 0),  # claims pop the head: it is the oldest waiting job
                  cmd("zcard", started_registry_key(name)),
                  cmd("zcount", history_failed_key(name), now - FAILED_WINDOW, "+inf"),
                  cmd("zcard", finished_registry_key(name)),
                  cmd("zcard", failed_registry_key(name))]
    replies = yield from gather(calls)
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
        enqueued = yield from gather([cmd("hget", job_key(head), "enqueued_at") for head in heads])
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


def pool_counters_plan(pool: str) -> Plan[dict[str, int]]:
    return _counters((yield from ask(cmd("hgetall", pool_counters_key(pool)))))


def snapshot(redis: Redis, pool: str, with_counters: bool = False) -> dict[str, Any]:
    return run(redis, snapshot_plan(pool, with_counters))


def snapshot_plan(pool: str, with_counters: bool = False) -> Plan[dict[str, Any]]:
    """Everything `fleet status` shows (JSON-ready)."""
    now = time.time()
    # a catalogue worker serves one pool a model
    ws = [w for w in (yield from workers_plan(with_counters))
          if pool in (w.get("pools") or [w.get("pool", pool)])]
    qs = yield from queues_plan(pool, now)
    counters = yield from pool_counters_plan(pool)
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
        "tokens_generated": counters.get(observe_schema.TOKENS, 0),
        "prompt_tokens": counters.get(observe_schema.PROMPT_TOKENS, 0),
        "cached_tokens": counters.get(observe_schema.CACHED_TOKENS, 0),
        "store_restores": counters.get(observe_schema.STORE_RESTORES, 0),
        "store_restored_tokens": counters.get(observe_schema.STORE_RESTORED_TOKENS, 0),
        "store_restore_ms": counters.get(observe_schema.STORE_RESTORE_MS, 0),
        "jobs": {o: counters.get(observe_schema.jobs_field(o), 0) for o in observe_schema.OUTCOMES},
    }
