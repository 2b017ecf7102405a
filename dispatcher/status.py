"""What `fleet status` shows: live workers (from their status hashes) and queue depths."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis import Redis

from backends.base import PRIORITIES
from dispatcher.keys import WORKERS_SET, queue_key, queue_name, worker_key

WORKER_FIELDS = ("name", "host", "pid", "cpus", "numa_node", "numa_memory", "backend", "state",
                 "inflight", "slots", "tokens", "tok_s", "rss_mb", "cpu_pct", "jobs_done", "jobs_failed")


def workers(redis: Redis) -> list[dict[str, Any]]:
    names = {_text(n) for n in redis.smembers(WORKERS_SET)}
    names |= {_text(k).split(":", 2)[2] for k in redis.scan_iter("fleet:worker:*", count=500)}
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
            pipe.zcard(f"rq:wip:{name}")
            pipe.zcard(f"rq:failed:{name}")
            pipe.zcard(f"rq:finished:{name}")
        replies = pipe.execute()
    for i, p in enumerate(PRIORITIES):
        depth, started, failed, finished = replies[4 * i : 4 * i + 4]
        rows.append({"queue": queue_name(pool, p), "priority": p, "depth": depth, "started": started,
                     "failed": failed, "finished": finished})
    return rows


def snapshot(redis: Redis, pool: str) -> dict[str, Any]:
    return {"workers": workers(redis), "queues": queues(redis, pool)}


def redact_url(url: str) -> str:
    """redis://user:secret@host/0 -> redis://user:***@host/0 (never print credentials)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    netloc = f"{user}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
