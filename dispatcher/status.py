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
    """A Redis URL fit to print: the password of `user:password@host` and of a `password=` (or
    `sentinel_password=`) query parameter become ***; the rest, IPv6 brackets and a Sentinel
    URL's host list included, stays as is."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        if ":" in userinfo:
            netloc = userinfo.split(":", 1)[0] + ":***@" + host
    query = "&".join(_redact_param(kv) for kv in parts.query.split("&")) if parts.query else ""
    shown = urlunsplit(parts._replace(netloc=netloc, query=query))
    if not netloc and url.startswith(f"{parts.scheme}://"):  # urlunsplit drops unix:///path's //
        shown = shown.replace(":", "://", 1)
    return shown


def _redact_param(kv: str) -> str:
    key = kv.split("=", 1)[0]
    return f"{key}=***" if key.lower() in ("password", "sentinel_password") else kv
