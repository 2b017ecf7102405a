"""The tenants' invariants: limits held while the run goes on (sampled), usage and per-minute
counters equal to what the jobs did (once quiet). The admission places themselves (open and
queued sets holding exactly the admitted, unended jobs) are the queue model's `places`
invariant (backends/contract/queue/invariants.py), not repeated here.

A limit is checked against what Redis holds, not what the gateway's sets say: the jobs of a
tenant in its queues and the workers' in-flight lists, read in one MULTI (a job moving between
them is counted once). Every job that runs or waits counts, whichever way it came (a request,
a batch line), since a tenant's limits bound what it takes from the fleet.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from redis import Redis

from backends.contract.keys import ATTEMPT_FIELD, job_key, tenant_rate_prefix
from backends.contract.replies import as_str
from dispatcher.plans import run
from dispatcher.tenants import totals_plan
from ecosystem.soak.client import Record
from ecosystem.soak.jobs import ENDED, JobInfo
from ecosystem.soak.plan import TENANTS
from ecosystem.soak.state import tenant_of_origin, waiting
from ecosystem.soak.verdict import Violation

USAGE_COUNTED = ("requests", "prompt_tokens", "completion_tokens", "failed")
EDGE_MS = 2000  # a job ending this close to a minute's edge may count in either minute


@dataclass
class Exceeded:
    tenant: str
    limit: str
    allowed: int
    worst: int
    first_at: float
    samples: int = 1
    jobs: tuple[str, ...] = ()


class LimitMonitor:
    """Samples every tenant's jobs in flight and waiting against its limits."""

    def __init__(self) -> None:
        self.origins: dict[str, str] = {}  # job id -> its queue (never changes)
        self.exceeded: dict[tuple[str, str], Exceeded] = {}
        self.samples = 0

    def sample(self, redis: Redis, now: float) -> None:
        snap = waiting(redis)
        unknown = sorted({j for ids in snap.inflight.values() for j in ids} - set(self.origins))
        if unknown:
            with redis.pipeline(transaction=False) as pipe:
                for job_id in unknown:
                    pipe.hget(job_key(job_id), "origin")
                for job_id, origin in zip(unknown, pipe.execute(), strict=True):
                    if origin is not None:
                        self.origins[job_id] = as_str(origin) or ""
        live: dict[str, list[str]] = {}
        queued: dict[str, list[str]] = {}
        for key, ids in snap.queues.items():
            tenant = tenant_of_origin(key.removeprefix("rq:queue:"))
            live.setdefault(tenant, []).extend(ids)
            queued.setdefault(tenant, []).extend(ids)
        for ids in snap.inflight.values():
            for job_id in ids:
                live.setdefault(tenant_of_origin(self.origins.get(job_id)), []).append(job_id)
        self.samples += 1
        for tenant, limits in TENANTS.items():
            if "max_concurrent" in limits and len(live.get(tenant, [])) > limits["max_concurrent"]:
                held = [j for j, _ in self._unended(redis, live[tenant])]
                self._check(tenant, "max_concurrent", limits["max_concurrent"], held, now)
            if "max_queued" in limits and len(queued.get(tenant, [])) > limits["max_queued"]:
                # a job handed back after it started (a dead worker, a drain) waits again but was
                # admitted and started: only jobs that never started count against max_queued
                fresh = [j for j, attempts in self._unended(redis, queued[tenant]) if not attempts]
                self._check(tenant, "max_queued", limits["max_queued"], fresh, now)

    def _unended(self, redis: Redis, ids: list[str]) -> list[tuple[str, int]]:
        """(job, attempts so far) of the jobs that have not ended: a cancelled batch line's queue
        entry stays until a claim drops it, but it holds nothing."""
        with redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hmget(job_key(job_id), ["status", ATTEMPT_FIELD])
            replies = pipe.execute()
        return [(j, int(attempts or 0)) for j, (status, attempts) in zip(ids, replies, strict=True)
                if as_str(status) not in ENDED]

    def _check(self, tenant: str, limit: str, allowed: int, ids: list[str], now: float) -> None:
        if len(ids) <= allowed:
            return
        seen = self.exceeded.get((tenant, limit))
        if seen is None:
            self.exceeded[(tenant, limit)] = Exceeded(tenant, limit, allowed, len(ids), now,
                                                      jobs=tuple(ids[:12]))
        else:
            seen.samples += 1
            if len(ids) > seen.worst:
                seen.worst, seen.jobs = len(ids), tuple(ids[:12])

    def violations(self) -> list[Violation]:
        out = []
        for e in self.exceeded.values():
            lines = sum(j.startswith("fbatch-") for j in e.jobs)
            note = f" ({lines} of those shown are batch lines)" if lines else ""
            out.append(Violation("tenant_limits", f"tenant '{e.tenant}' had {e.worst} jobs against its "
                                 f"{e.limit} of {e.allowed} (in {e.samples} samples); e.g. "
                                 f"{', '.join(e.jobs[:6])}{note}", e.first_at))
        return out


def usage_violations(redis: Redis, jobs: dict[str, JobInfo]) -> list[Violation]:
    """Each tenant's usage totals against the sum over the jobs a worker ended for it."""
    expected: dict[str, Counter[str]] = {}
    for info in jobs.values():
        if info.worker_ended:
            expected.setdefault(info.tenant, Counter()).update(info.usage())
    actual = run(redis, totals_plan())
    out = []
    for tenant in sorted(set(expected) | set(actual)):
        want, got = expected.get(tenant, Counter()), actual.get(tenant, {})
        wrong = [f"{f} {got.get(f, 0)} (jobs say {want.get(f, 0)})" for f in USAGE_COUNTED
                 if int(got.get(f, 0)) != want.get(f, 0)]
        if wrong:
            out.append(Violation("tenant_usage", f"tenant '{tenant}': " + ", ".join(wrong)))
    return out


def rate_violations(redis: Redis, jobs: dict[str, JobInfo], records: list[Record],
                    wall_t0: float) -> list[Violation]:
    """Each minute counter still in Redis against the jobs of its minute: tokens of the jobs a
    worker ended in it (exact but for jobs at its edges); requests, for tenants with limits
    (only admission counts them), at least the jobs created in it and at most those plus the
    requests answered without a job (admitted, then refused) and batch lines."""
    out = []
    by_tenant: dict[str, list[JobInfo]] = {}
    for info in jobs.values():
        by_tenant.setdefault(info.tenant, []).append(info)
    for key in sorted(as_str(k) or "" for k in redis.scan_iter(match="fleet:tenant:*:rate:*", count=1000)):
        head, _, minute_text = key.rpartition(":")
        tenant = head.removeprefix("fleet:tenant:").removesuffix(":rate")
        if head != tenant_rate_prefix(tenant) or not minute_text.isdigit():
            continue
        start, end = int(minute_text) * 60_000, (int(minute_text) + 1) * 60_000
        counts = {as_str(f): int(v) for f, v in redis.hgetall(key).items()}
        mine = by_tenant.get(tenant, [])
        ended = [(j.end_ms, j.tokens()) for j in mine if j.worker_ended and j.end_ms is not None]
        sure = sum(t for ms, t in ended if start + EDGE_MS <= ms < end - EDGE_MS)
        maybe = sum(t for ms, t in ended if start - EDGE_MS <= ms < end + EDGE_MS)
        if not sure <= counts.get("tokens", 0) <= maybe:
            out.append(Violation("tenant_rates", f"{key}: tokens {counts.get('tokens', 0)}, but the jobs "
                                 f"{tenant} ended in that minute used {sure}..{maybe}"))
        if tenant not in TENANTS or "requests" not in counts:
            continue
        created = [j.created_ms for j in mine if j.created_ms is not None and not j.batch_line]
        sure_n = sum(start + EDGE_MS <= ms < end - EDGE_MS for ms in created)
        maybe_n = sum(start - EDGE_MS <= ms < end + EDGE_MS for ms in created)
        spare = sum(1 for r in records if r.tenant == tenant and not r.job_ids and r.status is not None
                    and r.status >= 400 and r.status != 429
                    and start - EDGE_MS <= (wall_t0 + r.started) * 1000 < end + EDGE_MS)
        lines = sum(j.batch_line and j.created_ms is not None
                    and start - EDGE_MS <= j.created_ms < end + EDGE_MS for j in mine)
        if not sure_n <= counts["requests"] <= maybe_n + spare + lines:
            out.append(Violation("tenant_rates", f"{key}: requests {counts['requests']}, but {tenant} had "
                                 f"{sure_n}..{maybe_n} jobs admitted in that minute (+{spare} refused after "
                                 f"admission, +{lines} batch lines at most)"))
    return out
