"""Reads of the fleet's state in Redis that the fault scenarios and the checks share: which
tenant a job is, what a worker holds, which jobs are mid-stream, what is still queued or in
flight. Read-only."""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any

from redis import Redis

from backends.contract.keys import (
    OWNERS_SET,
    QUEUE_PREFIX,
    RQ_QUEUES_SET,
    WORKERS_SET,
    inflight_key,
    job_key,
    stream_key,
)
from backends.contract.queue import split_queue
from backends.contract.replies import as_str
from backends.contract.schema import DEFAULT_TENANT

INFLIGHT_PREFIX = inflight_key("")


def decode_strs(values: Any) -> list[str]:
    return [as_str(v) or "" for v in values or []]


def tenant_of_origin(origin: str | None) -> str:
    """The tenant a job's queue belongs to (its RQ origin)."""
    return split_queue(origin)[1] if origin else DEFAULT_TENANT


def job_request(raw: dict[bytes, bytes]) -> dict[str, Any] | None:
    """The request a job carries (RQ's JSON payload, zlib'd), or None for a tombstone or a payload
    that is not the fleet's."""
    data = raw.get(b"data")
    if not data:
        return None
    try:
        payload = json.loads(zlib.decompress(data))
    except (zlib.error, ValueError):
        try:
            payload = json.loads(data)
        except ValueError:
            return None
    try:
        request = payload[2][0]
    except (IndexError, KeyError, TypeError):
        return None
    return request if isinstance(request, dict) else None


def job_tenant(raw: dict[bytes, bytes]) -> str:
    """Whose a job is, as the worker counts it: the request's tenant, else its queue's."""
    request = job_request(raw) or {}
    named = request.get("tenant")
    return str(named) if named else tenant_of_origin(as_str(raw.get(b"origin")))


def queue_keys(redis: Redis) -> list[str]:
    return sorted(as_str(k) or "" for k in redis.scan_iter(match=QUEUE_PREFIX + "*", count=1000)
                  if redis.type(k) == b"list")


def inflight_keys(redis: Redis) -> list[str]:
    return sorted(as_str(k) or "" for k in redis.scan_iter(match=INFLIGHT_PREFIX + "*", count=1000))


@dataclass
class Waiting:
    """What is not done yet: each queue's and each in-flight list's job ids."""

    queues: dict[str, list[str]]
    inflight: dict[str, list[str]]

    @property
    def empty(self) -> bool:
        return not any(self.queues.values()) and not any(self.inflight.values())

    def describe(self, limit: int = 8) -> list[str]:
        out = []
        for key, ids in [*self.queues.items(), *self.inflight.items()]:
            if ids:
                shown = ", ".join(ids[:limit]) + (" ..." if len(ids) > limit else "")
                out.append(f"{key} holds {len(ids)}: {shown}")
        return out


def waiting(redis: Redis, scan: bool = False) -> Waiting:
    """Every queue and in-flight list, read in one MULTI (a job moving between them is seen once).
    The lists are found from the sets that name them (RQ's set of queues, which every enqueue
    joins; the workers seen and those that claimed), which costs the same however many keys the
    run has left; `scan`: by scanning the keyspace instead, which finds any list."""
    if scan:
        queues, inflights = queue_keys(redis), inflight_keys(redis)
    else:
        queues = sorted(as_str(k) or "" for k in redis.smembers(RQ_QUEUES_SET))
        names = redis.sunion([WORKERS_SET, OWNERS_SET])
        inflights = sorted(inflight_key(as_str(n) or "") for n in names)
    with redis.pipeline(transaction=True) as pipe:
        for key in queues + inflights:
            pipe.lrange(key, 0, -1)
        replies = pipe.execute()
    lists = [decode_strs(r) for r in replies]
    return Waiting(dict(zip(queues, lists[:len(queues)], strict=True)),
                   dict(zip(inflights, lists[len(queues):], strict=True)))


def held_tenant_jobs(redis: Redis, worker: str, streaming_only: bool = True) -> dict[str, str]:
    """Job id -> tenant of the named tenants' jobs the worker holds (with text in their stream
    already, unless `streaming_only` is False)."""
    out = {}
    for job_id in decode_strs(redis.lrange(inflight_key(worker), 0, -1)):
        tenant = tenant_of_origin(as_str(redis.hget(job_key(job_id), "origin")))
        if tenant == DEFAULT_TENANT:
            continue
        if streaming_only and not redis.xlen(stream_key(job_id)):
            continue
        out[job_id] = tenant
    return out


def held(redis: Redis, worker: str) -> list[str]:
    return decode_strs(redis.lrange(inflight_key(worker), 0, -1))
