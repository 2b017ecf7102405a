"""The queue model: every operation that changes the pool queues, the tenants' queues and fair
share, the in-flight lists and the tenants' admission places is defined here, once, for the
producers and the workers alike.

| operation | where | who runs it |
|---|---|---|
| admit | `admit.lua` (`admit_call`) | gateway, before it enqueues a tenant's jobs |
| enqueue | `enqueue_target` (RQ's writes in one MULTI: dispatcher/rules.py) | producers, batch submit |
| claim | `claim.lua` + `tenant_share.lua`, `balance.lua`, `placement.lua` (`CLAIM`) | worker |
| give way | `starved.lua` (`STARVED`, read only) | a full worker, when tenants share it |
| requeue | `requeue.lua` (`requeue_call`) | worker (engine failure, drain, outage, put back), reaper |
| cancel while queued | `cancel_queued.lua` (`cancel_queued_call`) | producers, gateway |
| end an RQ cancel | `end_rq_cancel.lua` (`end_rq_cancel_call`) | the workers' housekeeping |
| end | a hook in the worker's final MULTI (worker/hooks/tenant_usage.py: `release_calls`' keys) | worker |
| correct a charge | `fair_correct.lua` (`fair.correct_call`) | worker, in the end's MULTI (fair_share hook) |
| count spend | `count_spend.lua` (`count_spend_call`), in the same final MULTI | worker |
| read spend | `spent.lua` (`spent_call`, periods in `periods.lua`) | gateway (budgets), `fleet usage` |

Every script starts with the prelude (`scripts.py`): key names rendered from keys.py and the
shared rules (which tenant a queue is, how a tenant's job joins its queue and the fair share,
what its admission places are). `invariants.py` writes down what must hold between them.
"""

from __future__ import annotations

import json
from typing import Any

from backends.contract.keys import (
    QUEUE_PREFIX,
    USAGE_TENANTS,
    fair_key,
    job_key,
    spend_prefix,
    stream_key,
    tenant_open_key,
    tenant_queue_name,
    tenant_queued_key,
    tenant_rate_prefix,
    usage_prefix,
)
from backends.contract.queue.scripts import queue_script
from backends.contract.schema import DEFAULT_TENANT, PRIORITIES

# A tenant's place is reserved for PENDING_MS at admission and held for the job's lifetime once its
# enqueue (the same MULTI as RQ's writes) confirms it: a gateway that dies between the two leaves a
# place that frees itself within a minute, not within the job's lifetime.
PENDING_MS = 60_000
DEFAULT_RESERVATION_S = 3600  # a job waiting without queue_ttl: how long its place is held


def reservation_ms(queue_ttl: int | None, job_timeout: int) -> int:
    """How long a tenant's place is held for an enqueued job whose ending never comes (its
    records expired): the longest it may wait, plus the longest it may run."""
    return ((queue_ttl or DEFAULT_RESERVATION_S) + job_timeout) * 1000


CLAIM = queue_script("tenant_share.lua", "balance.lua", "placement.lua", "claim.lua")
STARVED = queue_script("tenant_share.lua", "starved.lua")
REQUEUE = queue_script("requeue.lua")
CANCEL_QUEUED = queue_script("cancel_queued.lua")
END_RQ_CANCEL = queue_script("end_rq_cancel.lua")
ADMIT = queue_script("admit.lua")
SPENT = queue_script("periods.lua", "spent.lua")
COUNT_SPEND = queue_script("count_spend.lua")

KeysArgs = tuple[list[str], list[Any]]


def split_queue(name: str) -> tuple[str, str]:
    """A queue name's pool queue and tenant (the prelude's `split_queue`): '<pool>:<priority>:<t>'
    is tenant t's queue, any other name the default tenant's."""
    base, _, tenant = name.rpartition(":")
    if (base and tenant != DEFAULT_TENANT and base.rpartition(":")[2] in PRIORITIES and ":" in base
            and 0 < len(tenant) <= 64 and all(c.isascii() and (c.isalnum() or c in "_.-") for c in tenant)):
        return base, tenant
    return name, DEFAULT_TENANT


def with_tenant_queues(queues: list[str], registered: list[str]) -> list[str]:
    """`queues` and the tenants' queues of them among `registered` (RQ's set of queue keys,
    `rq:queues`, which every enqueue joins): the queues whose registries a worker keeps."""
    bases = set(queues)
    names = (k.removeprefix(QUEUE_PREFIX) for k in registered if k.startswith(QUEUE_PREFIX))
    return [*queues, *sorted(n for n in names if n not in bases and split_queue(n)[0] in bases)]


def enqueue_target(queue: str, tenant: str | None) -> tuple[str, str | None]:
    """Where a job of pool queue `queue` for `tenant` waits, and the fair-share zset its tenant
    joins (None: the default tenant, whose jobs wait in the pool queue itself)."""
    target = tenant_queue_name(queue, tenant)
    return target, (fair_key(queue) if target != queue else None)


def requeue_call(inflight: str, job_id: str, *, bump_attempt: bool, died_on: str = "", counted: bool = True,
                 fallback_queue: str = "") -> KeysArgs:
    """Back to the front of the queue the job came from (its origin; `fallback_queue` when the
    job hash names none). `died_on`: a dead worker to remember; `counted=False`: a drain
    hand-back, which does not use up one of the job's attempts."""
    return ([inflight, job_key(job_id)],
            [job_id, "1" if bump_attempt else "0", died_on, "1" if counted else "0", fallback_queue])


def cancel_queued_call(job_id: str, result: dict[str, Any], ttl: int, now: float) -> KeysArgs:
    return [job_key(job_id), stream_key(job_id)], [job_id, json.dumps(result), ttl, now]


def end_rq_cancel_call(job_id: str, result: dict[str, Any], ttl: int) -> KeysArgs:
    return [job_key(job_id), stream_key(job_id)], [job_id, json.dumps(result), ttl]


def admit_call(tenant: str, job_ids: list[str], *, max_concurrent: int, max_queued: int,
               requests_per_minute: int, tokens_per_minute: int, lifetime_ms: int = PENDING_MS) -> KeysArgs:
    """`max_queued` -1 and the others 0 for no limit (the script's header); the places last
    `lifetime_ms` unless the enqueue confirms them (`confirm_places`)."""
    keys = [tenant_open_key(tenant), tenant_queued_key(tenant), tenant_rate_prefix(tenant),
            usage_prefix(tenant), USAGE_TENANTS]
    return keys, [len(job_ids), max_concurrent, max_queued, requests_per_minute, tokens_per_minute,
                  lifetime_ms, tenant, *job_ids]


def spent_call(tenant: str, key: str | None, periods: list[tuple[str, bool]]) -> KeysArgs:
    """A tenant's (or one of its named keys') spend over each (period, rolling) on Redis's clock
    (the script's header)."""
    return [spend_prefix(tenant, key)], [a for period, rolling in periods for a in (period, int(rolling))]


def count_spend_call(tenant: str, key: str | None, prompt: int, cached: int, completion: int) -> KeysArgs:
    return [spend_prefix(tenant, key)], [prompt, cached, completion]


def places_keys(tenant: str) -> tuple[str, str]:
    """A tenant's admission places: jobs admitted and not ended, admitted and not started."""
    return tenant_open_key(tenant), tenant_queued_key(tenant)


def confirm_places(tenant: str, job_id: str, expires_ms: int) -> list[tuple[str, dict[str, int]]]:
    """(zset, {job id: expiry}) pairs for the enqueue's MULTI to write with ZADD XX: a job
    admitted at the gateway holds its places until `expires_ms` from now on; a job nobody
    admitted (a Python or RQ producer's) gets none."""
    return [(key, {job_id: expires_ms}) for key in places_keys(tenant)]
