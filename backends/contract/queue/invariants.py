"""What must hold between the queue model's keys, written down as a check (the stateful test runs
it after every step, the soak when the fleet is quiet, and `fleet soak` names what broke).

- `fair-listed`: every named tenant's non-empty queue has its tenant in its pool queue's fair
  share (the claim visits only the tenants listed there: an unlisted queue is never claimed);
- `one-place`: a job id is in at most one list (a queue or one worker's in-flight list), and a
  job that has not ended is in exactly one: nothing is lost, nothing runs twice;
- `owner`: a job in a worker's in-flight list names that worker its owner, and a job waiting in
  a queue names none;
- `places`: a tenant's admission places (open: admitted and not ended; queued: admitted and not
  started) hold only jobs in that state, and queued ⊆ open: an ended or cancelled job gives its
  places back at once, not when its reservation expires (a place whose reservation expired is
  free: admission drops it). A place whose job does not exist is an admission whose enqueue never
  came (its gateway died, or Redis went away between the two): it must expire within PENDING_MS,
  never hold for a job's lifetime;
- `wip`: RQ's started registries name only executions of jobs a worker holds;
- `fair-spread` (`fair_spread_violations`, given the largest charge): no counter of a tenant with
  work runs ahead of the lowest by more than one job's worth (queue/fair.py).

The snapshot is read in one MULTI after listing the keys, so a quiet fleet (or a test that
steps the model itself) reads one consistent state.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from redis import Redis

from backends.contract.keys import (
    OWNER_FIELD,
    QUEUE_PREFIX,
    fair_key,
    inflight_key,
    job_key,
    queue_key,
    tenant_open_key,
    tenant_queue_name,
)
from backends.contract.queue import PENDING_MS, split_queue
from backends.contract.replies import as_str

ENDED = {"finished", "failed", "canceled", "stopped"}

_INFLIGHT_PREFIX = inflight_key("")
_TENANT_PREFIX, _OPEN_SUFFIX = tenant_open_key("\x00").split("\x00")
_WIP_PREFIX = "rq:wip:"
_JOB_PREFIX = job_key("")


@dataclass(frozen=True)
class Violation:
    invariant: str  # fair-listed, one-place, owner, places or wip (the module docstring)
    detail: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.detail}"


def _names(redis: Redis, pattern: str) -> list[str]:
    return sorted(as_str(k) or "" for k in redis.scan_iter(match=pattern, count=1000))


def _snapshot(redis: Redis) -> dict[str, Any]:
    queues = [k for k in _names(redis, QUEUE_PREFIX + "*") if redis.type(k) == b"list"]
    inflights = [k for k in _names(redis, _INFLIGHT_PREFIX + "*") if redis.type(k) == b"list"]
    fairs = [k for k in _names(redis, fair_key("*")) if not k.endswith((":clock", ":spent"))]
    places = [k for k in _names(redis, _TENANT_PREFIX + "*") if k.endswith((":open", ":queued"))]
    wips = [k for k in _names(redis, _WIP_PREFIX + "*") if redis.type(k) == b"zset"]
    jobs = _names(redis, _JOB_PREFIX + "*")
    seconds, micros = redis.time()
    now_ms = seconds * 1000 + micros // 1000
    with redis.pipeline(transaction=True) as pipe:
        for k in queues + inflights:
            pipe.lrange(k, 0, -1)
        for k in fairs + wips:
            pipe.zrange(k, 0, -1)
        for k in places:  # a place whose expiry passed is free: admission drops it first
            pipe.zrange(k, "(" + str(now_ms), "+inf", byscore=True, withscores=True)
        for k in jobs:
            pipe.hmget(k, ["status", OWNER_FIELD, "origin"])
        replies = iter(pipe.execute(raise_on_error=False))
    decode = lambda values: [as_str(v) or "" for v in values] if isinstance(values, list) else []  # noqa: E731
    return {
        "lists": {k: decode(next(replies)) for k in queues + inflights},
        "zsets": {k: decode(next(replies)) for k in fairs + wips},
        "places": {k: {as_str(m) or "": int(score) - now_ms for m, score in next(replies)} for k in places},
        "jobs": {k[len(_JOB_PREFIX):]: [as_str(v) for v in r] if isinstance(r, list) else None
                 for k, r in ((k, next(replies)) for k in jobs)},
        "queues": queues, "inflights": inflights,
    }


def queue_violations(redis: Redis) -> list[Violation]:
    """Every broken invariant of the queue model, each naming the job, queue or tenant."""
    snap = _snapshot(redis)
    lists: dict[str, list[str]] = snap["lists"]
    zsets: dict[str, list[str]] = snap["zsets"]
    jobs: dict[str, list[str | None] | None] = snap["jobs"]
    out: list[Violation] = []

    for key in snap["queues"]:
        name = key[len(QUEUE_PREFIX):]
        base, tenant = split_queue(name)
        if base != name and lists[key] and tenant not in zsets.get(fair_key(base), []):
            out.append(Violation("fair-listed", f"{key} holds {len(lists[key])} jobs but tenant '{tenant}' "
                                                f"is not in {fair_key(base)}: no claim visits it"))

    where: dict[str, list[str]] = {}
    for key in snap["queues"] + snap["inflights"]:
        for job_id in lists[key]:
            where.setdefault(job_id, []).append(key)
    for job_id, keys in where.items():
        if len(keys) > 1:
            copies = Counter(keys)
            places = ", ".join(f"{k} x{n}" if n > 1 else k for k, n in copies.items())
            out.append(Violation("one-place", f"job {job_id} is in {len(keys)} places: {places}"))
    held_by = {job_id: keys[0][len(_INFLIGHT_PREFIX):] for job_id, keys in where.items()
               if keys[0].startswith(_INFLIGHT_PREFIX)}
    for job_id, fields in jobs.items():
        if fields is None:
            continue
        status, owner, _origin = fields
        if status in ENDED:
            continue
        if job_id not in where:
            out.append(Violation("one-place", f"job {job_id} ({status}) is in no queue and no in-flight "
                                              f"list: lost"))
        elif job_id in held_by and owner != held_by[job_id]:
            out.append(Violation("owner", f"job {job_id} is in {_INFLIGHT_PREFIX}{held_by[job_id]} but its "
                                          f"owner is {owner!r}"))
        elif job_id not in held_by and owner:
            out.append(Violation("owner", f"job {job_id} waits in {where[job_id][0]} but names owner "
                                          f"{owner!r}"))

    admitted: dict[str, dict[str, int]] = snap["places"]  # key -> {job id: ms until it expires}
    for key, held_for in admitted.items():
        tenant, kind = key[len(_TENANT_PREFIX):].rsplit(":", 1)
        for job_id, left_ms in held_for.items():
            fields = jobs.get(job_id)
            status = fields[0] if fields else None
            if fields is None and left_ms > PENDING_MS:
                out.append(Violation("places", f"tenant '{tenant}' {kind} place held by job {job_id}, which "
                                               f"does not exist, for {left_ms / 1000:.0f}s more (an "
                                               f"admission never enqueued holds at most "
                                               f"{PENDING_MS // 1000}s)"))
            elif fields is not None and status in ENDED:
                out.append(Violation("places", f"tenant '{tenant}' {kind} place held by job {job_id}, which "
                                               f"ended ({status})"))
            elif kind == "queued" and status == "started":
                out.append(Violation("places", f"tenant '{tenant}' queued place held by job {job_id}, which "
                                               f"started"))
        if kind == "queued":
            missing = set(held_for) - set(admitted.get(f"{_TENANT_PREFIX}{tenant}{_OPEN_SUFFIX}", {}))
            for job_id in sorted(missing):
                out.append(Violation("places", f"job {job_id} is in tenant '{tenant}' queued set but not "
                                               f"its open set"))

    for key, members in zsets.items():
        if not key.startswith(_WIP_PREFIX):
            continue
        for member in members:
            job_id = member.split(":", 1)[0]
            if job_id not in held_by:
                out.append(Violation("wip", f"{key} names execution {member} of job {job_id}, which no "
                                            f"worker holds"))
    return out


def fair_spread_violations(redis: Redis, largest_charge: float) -> list[Violation]:
    """Each fair share whose tenants' counters (those lifted, with jobs queued) spread wider
    than `largest_charge` (the largest job charge over its tenant's weight: fair.spread_bound).
    A tenant still listed whose queue ran empty is not waiting: the claim drops it when it
    next visits it."""
    out: list[Violation] = []
    for key in _names(redis, fair_key("*")):
        if redis.type(key) != b"zset":
            continue
        base = key[len(fair_key("")):]
        scores: list[tuple[bytes, float]] = redis.zrange(key, 0, -1, withscores=True)  # type: ignore[assignment]
        counters = {tenant: score for tenant, score in ((as_str(m) or "", s) for m, s in scores)
                    if score >= 0 and redis.type(queue_key(tenant_queue_name(base, tenant))) == b"list"
                    and redis.llen(queue_key(tenant_queue_name(base, tenant)))}
        if counters and max(counters.values()) - min(counters.values()) > largest_charge + 1e-6:
            shown = ", ".join(f"{t}={v:g}" for t, v in sorted(counters.items(), key=lambda kv: kv[1]))
            out.append(Violation("fair-spread", f"{key}: {shown} spread wider than one job's worth "
                                                f"({largest_charge:g})"))
    return out
