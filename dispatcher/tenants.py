"""Tenants on the producer side (docs/tenants.md): admission against a tenant's limits, and its
usage read back.

Limits that must hold across gateway processes and hosts live in Redis and change in the one
script that admits (the queue model's admit.lua): jobs admitted and not ended (`max_concurrent`), admitted
and not started (`max_queued`), requests and tokens in this minute. A worker's hook
(worker/hooks/tenant_usage.py) lets go of a job's places as it starts and ends and counts its tokens, in
the same MULTI as the job's own final entry, so usage is counted exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from backends.contract import queue as queue_model
from backends.contract.gateway_settings import BudgetSettings, TenantSettings
from backends.contract.keys import (
    USAGE_TENANTS,
    USAGE_TTL,
    usage_key,
)
from backends.contract.replies import as_str
from dispatcher.plans import Eval, Plan, ask, cmd, gather

USAGE_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "queue_ms", "failed",
                "over_budget")
# what a refusal is counted under (`rejected_<name>`): the limits, and any hard budget
LIMIT_NAMES = ("requests_per_minute", "tokens_per_minute", "max_concurrent", "max_queued", "budget")


@dataclass(frozen=True)
class Limits:
    """A tenant's limits as admission checks them (None: no limit)."""

    max_concurrent: int | None = None
    max_queued: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.max_concurrent, self.max_queued, self.requests_per_minute,
                                           self.tokens_per_minute))

    def never_admits(self, jobs: int) -> tuple[str, int] | None:
        """The first limit that `jobs` asked for at once exceed by themselves, and its value: the
        script admits a request's jobs all or none, so no wait would ever admit them."""
        for limit in ("requests_per_minute", "max_concurrent", "max_queued"):
            allowed = getattr(self, limit)
            if allowed is not None and jobs > allowed:
                return limit, allowed
        return None


# what each limit counts, in the words of a refusal
COUNTED = {"requests_per_minute": "requests this minute", "tokens_per_minute": "tokens this minute",
           "max_concurrent": "jobs admitted and not ended", "max_queued": "jobs waiting to start"}


class LimitReached(Exception):
    """A request refused by one of its tenant's limits, for now: a later try may pass."""

    def __init__(self, tenant: str, limit: str, allowed: int, current: int, retry_after: int) -> None:
        self.tenant, self.limit, self.allowed, self.current = tenant, limit, allowed, current
        self.retry_after = max(1, retry_after)
        super().__init__(f"tenant '{tenant}' reached its {limit} limit of {allowed} ({current} "
                         f"{COUNTED[limit]}); retry after {self.retry_after}s")


class NeverAdmitted(Exception):
    """A request asking for more jobs at once than one of its tenant's limits allows at all."""

    def __init__(self, tenant: str, limit: str, allowed: int, asked: int) -> None:
        self.tenant, self.limit, self.allowed, self.asked = tenant, limit, allowed, asked
        super().__init__(f"this request asks for {asked} job{'s' if asked != 1 else ''} at once (a request "
                         f"with n choices is n jobs), more than tenant '{tenant}' ever allows: its {limit} "
                         f"is {allowed} ({COUNTED[limit]}), so no wait admits it and retrying does not help")


def admit_plan(tenant: str, job_ids: list[str], limits: Limits) -> Plan[None]:
    """Reserve `job_ids` under the tenant's limits; LimitReached refuses every one of them for
    now, NeverAdmitted for good (before any round trip: nothing is counted). The places last a
    minute unless the jobs' enqueue confirms them for their lifetime (the queue model's
    PENDING_MS, confirm_places)."""
    if (never := limits.never_admits(len(job_ids))) is not None:
        raise NeverAdmitted(tenant, *never, len(job_ids))
    keys, args = queue_model.admit_call(
        tenant, job_ids, max_concurrent=limits.max_concurrent or 0,
        max_queued=-1 if limits.max_queued is None else limits.max_queued,
        requests_per_minute=limits.requests_per_minute or 0, tokens_per_minute=limits.tokens_per_minute or 0)
    reply = yield from ask(Eval(queue_model.ADMIT, keys, args))
    verdict = as_str(reply[0])
    if verdict == "ok":
        return
    limit = str(verdict)
    allowed = getattr(limits, limit)
    raise LimitReached(tenant, limit, int(allowed), int(reply[2]), int(reply[1]))


def release_plan(tenant: str, job_ids: list[str]) -> Plan[None]:
    """Give back reservations of jobs that were never enqueued."""
    if job_ids:
        yield from gather([cmd("zrem", key, *job_ids) for key in queue_model.places_keys(tenant)])


@dataclass(frozen=True)
class Spend:
    """A tenant's tokens over one budget's period, and when the period resets (unix seconds)."""

    tokens: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    resets_at: int


def spend_call(tenant: str, periods: list[tuple[str, bool]], key: str | None = None) -> Eval:
    """Read Redis's time and the tenant's (or its named key's) spend over each (period, rolling)
    (counted by the workers as jobs end: worker/hooks/tenant_usage.py); `spends` reads the reply."""
    keys, args = queue_model.spent_call(tenant, key, periods)
    return Eval(queue_model.SPENT, keys, args)


def spends(reply: Any) -> tuple[int, list[Spend]]:
    now, spent = reply
    return int(now), [Spend(*(int(v) for v in row)) for row in spent]


def spend_plan(tenant: str, periods: list[tuple[str, bool]],
               key: str | None = None) -> Plan[tuple[int, list[Spend]]]:
    return spends((yield from ask(spend_call(tenant, periods, key))))


def utc(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class BudgetReached(Exception):
    """A request refused by a hard budget until the budget's period resets."""

    def __init__(self, who: str, budget: BudgetSettings, spend: Spend, now: int) -> None:
        self.budget, self.spend = budget, spend
        self.retry_after = max(1, spend.resets_at - now)
        resets = "resets" if not budget.rolling else "its oldest day leaves it"
        super().__init__(f"{who} reached its {budget.name} budget of {budget.tokens:,} tokens "
                         f"({spend.tokens:,} spent); {resets} at {utc(spend.resets_at)}, "
                         f"in {self.retry_after}s")


Spenders = list[tuple[str | None, list[BudgetSettings]]]  # the tenant (None) or a named key: budgets


def budget_plan(tenant: str, spenders: Spenders) -> Plan[dict[str, str]]:
    """Check the tenant's budgets and its named key's before admitting its request: BudgetReached
    for a hard budget reached (counted as the tenant's `rejected_budget`); for soft ones reached
    only, the headers that mark the answer (counted as `over_budget`)."""
    reached: list[tuple[str, BudgetSettings, Spend]] = []
    now = 0
    counted = [(key, budgets) for key, budgets in spenders if budgets]
    replies = yield from gather([spend_call(tenant, [(b.period, b.rolling) for b in budgets], key)
                                 for key, budgets in counted])  # one round trip for all of them
    for (key, budgets), reply in zip(counted, replies, strict=True):
        now, spent = spends(reply)
        who = f"tenant '{tenant}'" + (f" key '{key}'" if key else "")
        reached += [(who, b, s) for b, s in zip(budgets, spent, strict=True) if s.tokens >= b.tokens]
    if not reached:
        return {}
    # of the hard budgets reached, the one that resets last: retrying sooner would be refused again
    hard = max((r for r in reached if r[1].hard), key=lambda r: r[2].resets_at, default=None)
    field = "rejected_budget" if hard else "over_budget"
    hour = now // 3600
    yield from gather([cmd("hincrby", usage_key(tenant, h), field, 1) for h in (hour, "total")]
                      + [cmd("expire", usage_key(tenant, h), USAGE_TTL) for h in (hour, "total")]
                      + [cmd("zadd", USAGE_TENANTS, {tenant: hour}), cmd("expire", USAGE_TENANTS, USAGE_TTL)])
    if hard:
        raise BudgetReached(*hard, now)
    _, budget, spend = reached[0]
    return {"x-fleet-budget-exceeded": ",".join(b.name for _, b, _ in reached),
            "x-fleet-budget-limit": str(budget.tokens), "x-fleet-budget-spent": str(spend.tokens),
            "x-fleet-budget-reset": utc(spend.resets_at)}


@dataclass(frozen=True)
class BudgetLine:
    """A tenant's spend over a period, against its budget for that period if it has one."""

    tenant: str
    period: str  # the budget's name ('month', 'rolling-30d'); the calendar period without one
    spend: Spend
    budget: BudgetSettings | None
    cost: float | None  # by the tenant's prices, if set

    def json(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "period": self.period, **vars(self.spend), "cost": self.cost,
                "resets_at": utc(self.spend.resets_at),
                "budget": None if self.budget is None else {"tokens": self.budget.tokens,
                                                            "hard": self.budget.hard}}


def budget_report_plan(tenants: Mapping[str, TenantSettings], tenant: str | None,
                       period: str) -> Plan[list[BudgetLine]]:
    """Each tenant's spend over `period` (one tenant, or the configured ones and every one seen),
    then each of its named keys': over its budget for that period, calendar or rolling, if it has
    one, else the calendar one."""
    if tenant is not None:
        names = [tenant]
    else:
        seen = yield from ask(cmd("zrange", USAGE_TENANTS, 0, -1))
        names = sorted(set(tenants) | {as_str(t) or "" for t in seen})
    out = []
    for name in names:
        settings = tenants.get(name) or TenantSettings()
        spenders: Spenders = [(None, settings.budgets)]
        spenders += [(key, named.budgets) for key, named in settings.keys.items()]
        for key, budgets in spenders:
            budget = next((b for b in budgets if b.period == period), None)
            _, (spend,) = yield from spend_plan(name, [(period, budget is not None and budget.rolling)], key)
            prices = settings.prices
            cost = None if prices is None else prices.cost(spend.prompt_tokens, spend.cached_tokens,
                                                           spend.completion_tokens)
            shown = name if key is None else f"{name} (key {key})"
            out.append(BudgetLine(shown, budget.name if budget else period, spend, budget, cost))
    return out


Usage = dict[str, dict[str, int]]  # tenant -> field -> count


def totals_plan() -> Plan[Usage]:
    """Every tenant's counts since it was first seen (monotonic while it stays active within the
    usage TTL: what Prometheus reads)."""
    tenants = sorted(as_str(t) or "" for t in (yield from ask(cmd("zrange", USAGE_TENANTS, 0, -1))))
    replies = yield from gather([cmd("hgetall", usage_key(t, "total")) for t in tenants])
    return {t: _counts([raw]) for t, raw in zip(tenants, replies, strict=True)}


def _counts(hashes: list[Any]) -> dict[str, int]:
    total = {f: 0 for f in USAGE_FIELDS}
    for raw in hashes:
        for field, value in (raw or {}).items():
            name = as_str(field) or ""
            try:
                total[name] = total.get(name, 0) + int(value)
            except ValueError:
                continue  # not a count: nothing the fleet wrote
    return total


def usage_plan(tenant: str | None, since_hours: int, now: float | None = None) -> Plan[Usage]:
    """Usage per tenant (one tenant, or every tenant seen) over the last `since_hours` hours,
    this hour included: fields of USAGE_FIELDS and `rejected_<limit>`."""
    hour = int((now if now is not None else time.time()) // 3600)
    if tenant is not None:
        tenants = [tenant]
    else:
        tenants = sorted(as_str(t) or "" for t in (yield from ask(cmd("zrange", USAGE_TENANTS, 0, -1))))
    hours = range(hour - since_hours + 1, hour + 1)
    replies = yield from gather([cmd("hgetall", usage_key(t, h)) for t in tenants for h in hours])
    return {t: _counts(replies[i * len(hours):(i + 1) * len(hours)]) for i, t in enumerate(tenants)}
