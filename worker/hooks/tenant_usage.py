"""The tenants concern (a hook: worker/hooks/__init__.py): a job lets go of its tenant's admission places
as it starts and ends, and its ending counts into the tenant's usage (requests, tokens, cached
prompt tokens, queue wait, failures: this hour's hash), this minute's tokens (what
`tokens_per_minute` admits against) and today's spend (what budgets sum), all in the same MULTI
as the job's own writes, so each is counted exactly once. Jobs naming no tenant count as the
default tenant's. Keys: dispatcher/tenants.py, backends/contract/keys.py."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from redis.client import Pipeline

from backends.contract import queue as queue_model
from backends.contract.keys import (
    USAGE_TENANTS,
    USAGE_TTL,
    tenant_rate_prefix,
    usage_key,
)
from backends.contract.lua import queue_script
from worker.job import tenant_of

if TYPE_CHECKING:
    from worker.hooks import Holder, Restart
    from worker.job import ClaimedJob, Ending

RATE_TTL = 120  # seconds a minute's counts are kept (the admission script reads this minute's)


class TenantUsage:
    def on_start(self, job: ClaimedJob, holder: Holder, pipe: Pipeline) -> None:
        pipe.zrem(queue_model.places_keys(tenant_of(job))[1], job.id)  # queued: it started

    def on_restart(self, restart: Restart, pipe: Pipeline) -> None:
        pass  # still admitted; a job the reaper gives up on ends (on_end frees its places)

    def on_end(self, job: ClaimedJob, ending: Ending, holder: Holder, pipe: Pipeline) -> None:
        tenant, now = tenant_of(job), time.time()
        for key in queue_model.places_keys(tenant):  # open and queued: it ended
            pipe.zrem(key, job.id)
        counts: dict[str, int] = {"requests": 1}
        result = ending.result
        if result is None:
            counts["failed"] = 1
        else:
            used, timings = result.get("usage") or {}, result.get("timings") or {}
            counts["prompt_tokens"] = int(used.get("prompt_tokens") or 0)
            counts["completion_tokens"] = int(used.get("completion_tokens") or 0)
            counts["cached_tokens"] = int(used.get("cached_tokens") or 0)
            counts["queue_ms"] = int(timings.get("queue_ms") or 0)
            rate = f"{tenant_rate_prefix(tenant)}:{int(now // 60)}"
            pipe.hincrby(rate, "tokens", counts["prompt_tokens"] + counts["completion_tokens"])
            pipe.expire(rate, RATE_TTL)
            named = job.request.key_name if job.request is not None else None
            for spender in {None, named}:  # the tenant's, and its named key's
                queue_script(pipe, queue_model.COUNT_SPEND, *queue_model.count_spend_call(
                    tenant, spender, counts["prompt_tokens"], counts["cached_tokens"],
                    counts["completion_tokens"]))
        for usage in (usage_key(tenant, int(now // 3600)), usage_key(tenant, "total")):
            for field, n in counts.items():
                pipe.hincrby(usage, field, n)
            pipe.expire(usage, USAGE_TTL)
        pipe.zadd(USAGE_TENANTS, {tenant: int(now // 3600)})
        pipe.expire(USAGE_TENANTS, USAGE_TTL)
