"""What `fleet status` shows: live workers (from their status hashes) and queue depths."""

from __future__ import annotations

import json
from typing import Any

from redis import Redis

from backends.contract.keys import (
    WORKER_PREFIX,
    WORKERS_SET,
    failed_registry_key,
    finished_registry_key,
    queue_key,
    queue_name,
    started_registry_key,
    worker_key,
    worker_name_of,
)
from backends.contract.schema import PRIORITIES

WORKER_FIELDS = ("name", "host", "pid", "cpus", "numa_node", "numa_memory", "backend", "state",
                 "inflight", "slots", "tokens", "tok_s", "rss_mb", "cpu_pct", "jobs_done", "jobs_failed")


def workers(redis: Redis) -> list[dict[str, Any]]:
    names = {_text(n) for n in redis.smembers(WORKERS_SET)}
    names |= {worker_name_of(_text(k)) for k in redis.scan_iter(f"{WORKER_PREFIX}*", count=500)}
    out = []
    for name in sorted(names):
        raw = redis.hgetall(worker_key(name))
        if not raw:
            continue  # registered but dead: the reaper will collect it
        out.append({_text(k): json.loads(v) for k, v in raw.items()})
    return out


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def queues(redis: Redis, pool: str) -> list[dict[str, Any]]:
    rows = []
    with redis.pipeline(transaction=False) as pipe:
        for p in PRIORITIES:
            name = queue_name(pool, p)
            pipe.llen(queue_key(name))
            pipe.zcard(started_registry_key(name))
            pipe.zcard(failed_registry_key(name))
            pipe.zcard(finished_registry_key(name))
        replies = pipe.execute()
    for i, p in enumerate(PRIORITIES):
        depth, started, failed, finished = replies[4 * i : 4 * i + 4]
        rows.append({"queue": queue_name(pool, p), "priority": p, "depth": depth, "started": started,
                     "failed": failed, "finished": finished})
    return rows


def snapshot(redis: Redis, pool: str) -> dict[str, Any]:
    return {"workers": workers(redis), "queues": queues(redis, pool)}

