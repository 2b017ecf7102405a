"""What both HTTP APIs share: the fleet handle, admission (auth, model -> pool, 503 without
workers, 429 when the queue is full), submitting a request's jobs (following them:
following.py).

Protocol quirks (SSE, NDJSON, field names, error shapes) stay in openai_api.py / ollama_api.py;
this module speaks only in fleet terms.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from backends.contract.catalogue import ModelEntry, live_models, model_pools, stored_entry
from backends.contract.gateway_settings import GatewaySettings, TenantSettings
from backends.contract.keys import (
    CATALOGUE_KEY,
    UNLOADED_KEY,
    WORKERS_SET,
    queue_key,
    queue_names,
    tenant_queue_name,
    worker_key,
)
from backends.contract.replies import as_str
from backends.contract.retry import OUTAGE_ERRORS
from backends.contract.schema import DEFAULT_TENANT, PRIORITIES
from backends.gguf import GgufError, file_card
from backends.model import cached_digest, file_digest
from dispatcher.aio import AsyncFleet, AsyncFleetJob
from dispatcher.gateway.settings import ServeSettings
from dispatcher.plans import run_async
from dispatcher.rules import new_job_id
from dispatcher.tenants import (
    BudgetReached,
    LimitReached,
    Limits,
    NeverAdmitted,
    Spenders,
    admit_plan,
    budget_plan,
    release_plan,
)

log = logging.getLogger("fleet.gateway")
REFRESH_INTERVAL = 1.0  # seconds between reads of the workers' status hashes
NOT_SERVING = ("draining", "stopped")  # worker states that claim no new job
MEMORY_SAID = ("need_mb", "room_mb")  # what a worker's cannot_hold entry says of a model (ints)


class ApiError(Exception):
    """An HTTP error; each API renders it in its own error shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.kind = kind  # OpenAI's error `type`, where the status alone does not tell it


def ollama_route(path: str) -> bool:
    """Whether `path` is one of Ollama's routes (its error shape, its leniency on Content-Type)."""
    return path.startswith("/api/")


def shown(value: object, limit: int = 100) -> str:
    """A client's value as it may appear in an error message: unprintable characters (lone
    surrogates, controls) escaped, so any JSON encoder can write it, and at most `limit` long."""
    text = str(value)
    cut = text[:limit]
    out = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in cut)
    return out + ("..." if len(text) > limit else "")


MAX_NAMED = 20  # unsupported fields one message names (a body may hold thousands)


def unsupported(fields: str | Sequence[str], api: str) -> ApiError:
    """The 400 for fields this gateway cannot honour: the message names every one (so a client
    fixes them all at once), `param` the first."""
    names = [fields] if isinstance(fields, str) else list(fields)
    listed = ", ".join(f"'{shown(f)}'" for f in names[:MAX_NAMED])
    if len(names) > MAX_NAMED:
        listed += f" and {len(names) - MAX_NAMED} more"
    verb = "is" if len(names) == 1 else "are"
    return ApiError(400, f"{listed} {verb} not supported by this {api} gateway (llama-fleet)",
                    param=shown(names[0]), code="unsupported_field")


# -- what a client is told about a failed job -------------------------------------------------------

# A Python exception's type, with its module path (`ValueError: `, `httpx.ReadTimeout: `)
PYTHON_TYPE = re.compile(r"\b(?:[a-z_][a-z0-9_]*\.)*[A-Z][A-Za-z0-9]*"
                         r"(?:Error|Exception|Warning|Exit|Interrupt|Timeout|Rejected|Refused|Failed|Unavailable)"
                         r"\b(?::\s*)?")
SOURCE_LINE = re.compile(r'File "[^"]*", line \d+(?:, in \S+)?')
INTERNAL = "internal error"


def public_reason(error: str, limit: int = 500) -> str:
    """A worker's failure reason as a client may read it: no traceback, no Python type names or
    source paths (the gateway's log keeps the worker's own words)."""
    reason = error.split("Traceback (most recent call last)", 1)[0]
    if reason.lower().startswith(INTERNAL):
        head = reason.split(":", 1)[0].strip()
        return f"{head} (the worker's log has the details)"
    reason = SOURCE_LINE.sub("", PYTHON_TYPE.sub("", reason))
    reason = re.sub(r"\s+", " ", reason).strip(" :;,") or "the job failed on its worker"
    return reason if len(reason) <= limit else reason[:limit] + "..."


@dataclass
class JobUpdate:
    """Something new about job `index` of a request: text, or its end (result or error)."""

    index: int
    delta: str = ""
    result: dict[str, Any] | None = None
    error: str | None = None
    timed_out: bool = False  # gateway.request_timeout passed; the request's jobs are cancelled

    @property
    def final(self) -> bool:
        return self.result is not None or self.error is not None


@dataclass(frozen=True)
class Caller:
    """Who a request comes from: its tenant (the default one for the flat `api_keys` and without
    keys); `admin`: an operator's key (`admin_keys`: every tenant's data); `operator`: may see
    the dashboard and metrics (admin keys, and the flat `api_keys` while neither tenants nor
    admin keys are configured, as before tenants)."""

    tenant: str
    admin: bool = False
    operator: bool = False
    key: str | None = None  # one of the tenant's named keys (its own budgets)

    @property
    def owner(self) -> str:
        """What the caller's files and batches are recorded under."""
        return f"tenant:{self.tenant}"


OPEN = Caller(DEFAULT_TENANT)  # no keys configured: everyone is the default tenant


@dataclass(frozen=True)
class Served:
    """One model the gateway serves: the pool that runs it and the names a request may use; the
    first is the one Ollama's listings show (docs/gateway.md, "Models and pools")."""

    pool: str
    names: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.names[0]


def catalogue_cards(models: dict[str, ModelEntry]) -> dict[str, dict[str, Any]]:
    """The catalogue's models' cards from their GGUF headers, by pool: true listings before any
    worker loads them (a file this host cannot read has none: a fetched model not on this host)."""
    cards = {}
    for name, pool in model_pools(models).items():
        entry = models[name]
        if entry.url is not None and not entry.path.exists():
            cards[pool] = {"digest": entry.sha256 or "", "context_length": entry.n_ctx_per_seq or 0}
            continue
        try:
            cards[pool] = {**file_card(entry.path), "context_length": entry.n_ctx_per_seq or 0,
                           "digest": cached_digest(entry.path) or "",
                           **({"capabilities": ["embedding"]} if entry.embedding else {})}
        except (OSError, GgufError) as e:
            log.warning("model %s: no card from %s (%s)", name, entry.path, e)
    return cards


class Gateway:
    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.fleet = AsyncFleet(settings.redis_url, pool=settings.pool, result_ttl=settings.result_ttl,
                                job_timeout=settings.job_timeout, queue_ttl=settings.queue_ttl,
                                retry_for=5.0)
        self._fleets: dict[str, AsyncFleet] = {settings.pool: self.fleet}
        # pool -> its model's Ollama-style name, as its live workers last said (kept when they go)
        self.model_names: dict[str, str] = {}
        # pool -> the last model card read of its workers; a catalogue model's from its file at first
        self.cards: dict[str, dict[str, Any]] = {}
        # the catalogue (the config's, then the live one: CATALOGUE_KEY), its names (name -> pool)
        # and the pools whose models workers load and unload
        self.live_catalogue: dict[str, ModelEntry] = {}
        self._catalogue_raw: dict[bytes, bytes] = {}
        self.models: dict[str, str] = {}
        self.catalogue_pools: set[str] = set()
        self.adopt({})
        self.thinking_pools: set[str] = set()  # pools whose live workers' templates think
        self.live_workers: dict[str, int] = {}  # pool -> serving workers, refreshed every second
        self.pool_members: dict[str, list[str]] = {}  # pool -> the names of those workers
        # pool -> what each of those workers that could never load its model says (need, room)
        self.cannot_hold: dict[str, list[dict[str, Any]]] = {}
        self.redis_up = False
        self._keys = caller_keys(settings.gateway)
        self._refresher: asyncio.Task[None] | None = None
        self._digests: asyncio.Task[None] | None = None

    async def start(self) -> None:
        with contextlib.suppress(*OUTAGE_ERRORS):  # Redis away at start: the gateway waits for it
            await self.fleet.check_server()  # too old a Redis stops the gateway here, not at a request
        await self.refresh()
        self._refresher = asyncio.create_task(self._refresh_forever(), name="fleet-gateway-refresh")
        self._digests = asyncio.create_task(self._learn_digests(), name="fleet-gateway-digests")

    async def _learn_digests(self) -> None:
        """The sha256 of each catalogue file not yet cached, read on a thread (a large file takes
        seconds; listings show none meanwhile), unless a worker published its card first."""
        catalogue = self.live_catalogue
        for name, pool in model_pools(catalogue).items():
            card = self.cards.get(pool)
            if card is not None and not card.get("digest"):
                try:
                    digest = await asyncio.to_thread(file_digest, catalogue[name].path)
                except OSError as e:
                    log.warning("model %s: cannot read its file's digest (%s)", name, e)
                    continue
                self.cards[pool] = {**self.cards[pool], "digest": self.cards[pool].get("digest") or digest}

    async def stop(self) -> None:
        for task in (self._refresher, self._digests):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.fleet.aclose()

    # -- state of the fleet ---------------------------------------------------------------------

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_INTERVAL)
            await self.refresh()

    async def drop_idle_connections(self) -> None:
        """Close the pool's idle connections: after a Redis restart each one is dead, and each
        would fail one request (a 503) long after Redis came back. Connections in use fail and
        close themselves."""
        with contextlib.suppress(Exception):
            await self.fleet.redis.connection_pool.disconnect(inuse_connections=False)

    async def refresh(self) -> None:
        """Count live, serving workers per pool from their status hashes (TTL = liveness)."""
        redis = self.fleet.redis
        try:
            names = sorted(as_str(n) or "" for n in await redis.smembers(WORKERS_SET))
            async with redis.pipeline(transaction=False) as pipe:
                pipe.hgetall(CATALOGUE_KEY)
                for name in names:
                    pipe.hmget(worker_key(name), ["pool", "state", "model", "thinks", "pools", "cannot_hold"])
                catalogue_raw, *replies = await pipe.execute()
        except OUTAGE_ERRORS as e:
            if self.redis_up:
                log.warning("Redis unreachable: %s", e)
            self.redis_up = False
            await self.drop_idle_connections()
            return
        if catalogue_raw != self._catalogue_raw:
            self.adopt(catalogue_raw)
        counts: dict[str, int] = {}
        members: dict[str, list[str]] = {}
        model_names: dict[str, str] = {}
        thinking: set[str] = set()
        cannot_hold: dict[str, list[dict[str, Any]]] = {}
        for name, (pool_raw, state_raw, model_raw, thinks, pools_raw, too_big_raw) in zip(names, replies,
                                                                                           strict=True):
            if pool_raw is None:
                continue  # its hash expired: dead (the reaper collects it)
            pool, state = json.loads(pool_raw), json.loads(state_raw or '""')
            if state not in NOT_SERVING:
                too_big = json.loads(too_big_raw or "{}")
                for served in json.loads(pools_raw or "null") or [pool]:  # a catalogue worker: every model's
                    counts[served] = counts.get(served, 0) + 1
                    members.setdefault(served, []).append(name)
                    said = too_big.get(served) if isinstance(too_big, dict) else None
                    if isinstance(said, dict) and all(isinstance(said.get(k), int) for k in MEMORY_SAID):
                        cannot_hold.setdefault(served, []).append(said)
                model = json.loads(model_raw or '""')
                if isinstance(model, str) and model and pool not in model_names:
                    model_names[pool] = model
                if json.loads(thinks or "false") is True:
                    thinking.add(pool)
        self.model_names = {**self.model_names, **model_names}
        self.live_workers = counts
        self.pool_members = members
        self.cannot_hold = cannot_hold
        self.thinking_pools = thinking
        self.redis_up = True

    def adopt(self, raw: dict[bytes, bytes]) -> None:
        """The live catalogue (CATALOGUE_KEY) as every gateway serves it from the next refresh:
        its names, pools and cards (a pool's card its workers wrote stays until they write again)."""
        self._catalogue_raw = raw
        self.live_catalogue = live_models(self.settings.models, raw, self.settings.models_dir())
        self.models = self.settings.model_pools(self.live_catalogue)
        self.catalogue_pools = set(model_pools(self.live_catalogue).values())
        new = {n: e for n, e in self.live_catalogue.items() if e.pool_of(n) not in self.cards}
        self.cards.update(catalogue_cards(new))

    async def change_catalogue(self, name: str, entry: ModelEntry | None) -> None:
        """Add, replace or (None) delete a model of the live catalogue, seen by this gateway at
        once and by the others and the workers at their next refresh."""
        if entry is not None:
            value = json.dumps(stored_entry(entry, self.settings.models_dir()))
            await self.fleet.redis.hset(CATALOGUE_KEY, name, value)
        elif name in self.settings.models:
            await self.fleet.redis.hset(CATALOGUE_KEY, name, "null")
        else:
            await self.fleet.redis.hdel(CATALOGUE_KEY, name)
        await self.refresh()

    def fleet_for(self, pool: str) -> AsyncFleet:
        if pool not in self._fleets:
            self._fleets[pool] = self.fleet.for_pool(pool)
        return self._fleets[pool]

    # -- admission ------------------------------------------------------------------------------

    def identify(self, authorization: str | None, api_key: str | None = None) -> Caller | None:
        """No keys configured: open (the default tenant). Else the caller whose key `Bearer <key>`
        (`authorization`) is, else whose key `api_key` (the `x-api-key` header, Anthropic's) is,
        compared in constant time (both against every key, so timing tells nothing about which
        matched); None for no valid key."""
        if not self._keys:
            return OPEN
        scheme, _, given = (authorization or "").partition(" ")
        bearer = given.strip().encode() if scheme.lower() == "bearer" else b""
        header = (api_key or "").strip().encode()
        by_bearer = by_header = None
        for key, caller in self._keys:
            if hmac.compare_digest(bearer, key):
                by_bearer = caller
            if hmac.compare_digest(header, key):
                by_header = caller
        return by_bearer or by_header

    def tenant(self, caller: Caller) -> TenantSettings | None:
        return self.settings.gateway.tenants.get(caller.tenant)

    def catalogue(self) -> list[Served]:
        """Every model served, one entry per configured name. A pool served under its own name
        (the default: no `gateway.models`) is listed under its model's Ollama-style name once its
        workers told it (gemma3:270m), the pool's name staying an alias; a name the operator gave
        in `gateway.models` stays the name. A derived name that two pools share, or that is
        configured already, is not used."""
        derived = {pool: name for pool, name in self.model_names.items() if pool in self.models.values()}
        shared = Counter(derived.values())
        out = []
        for name, pool in self.models.items():
            alias = derived.get(pool, "")
            usable = name == pool and alias and shared[alias] == 1 and alias not in self.models
            out.append(Served(pool, (alias, name) if usable else (name,)))
        return out

    def served_for(self, caller: Caller) -> list[Served]:
        """The models `caller` may use: those its tenant's `models` name (by either name), else
        every one. A model the tenant may not use does not exist for it, in listings as in requests."""
        tenant = self.tenant(caller)
        models = self.catalogue()
        if tenant is None or tenant.models is None:
            return models
        allowed = set(tenant.models)
        return [m for m in models if allowed.intersection(m.names)]

    def models_for(self, caller: Caller) -> dict[str, str]:
        """Every name `caller` may use -> its pool."""
        return {name: m.pool for m in self.served_for(caller) for name in m.names}

    def may_unload(self, caller: Caller) -> bool:
        """Whether `caller` may unload a model (Ollama's keep_alive 0): an operator (an admin key;
        the flat api_keys while neither tenants nor admin keys are configured), or anyone on a
        gateway without keys. A tenant shares the models with others, so it may not."""
        return caller.operator or not self._keys

    async def set_unloaded(self, pool: str, unloaded: bool) -> None:
        """Mark the pool's model unloaded (Ollama's /api/ps leaves it out) or loaded again."""
        try:
            if unloaded:
                await self.fleet.redis.hset(UNLOADED_KEY, pool, str(round(time.time(), 3)))
            else:
                await self.fleet.redis.hdel(UNLOADED_KEY, pool)
        except OUTAGE_ERRORS:
            raise ApiError(503, "the fleet's Redis is unreachable", code="redis_unavailable") from None

    def pool_for(self, model: object, caller: Caller = OPEN) -> str:
        if not isinstance(model, str) or not model:
            raise ApiError(400, "'model' is required: the name of a model this gateway serves",
                           param="model", code="missing_model")
        served = self.models_for(caller)
        pool = served.get(model)
        untagged = model.removesuffix(":latest")
        if pool is None and untagged != model and ":" not in untagged:
            pool = served.get(untagged)  # Ollama's rule: a name without a tag is <name>:latest
        if pool is None:
            raise ApiError(404, f"The model '{shown(model)}' does not exist (this gateway serves: "
                           f"{', '.join(sorted(served))})", param="model", code="model_not_found")
        return pool

    async def submit(self, pool: str, requests: list[dict[str, Any]], priority: str,
                     caller: Caller = OPEN) -> tuple[list[AsyncFleetJob], dict[str, str]]:
        """Admit and enqueue a request's jobs (one per choice) as `caller`'s tenant. 503 without a
        live worker for the pool, 429 when more than `max_queue` of the tenant's jobs wait in it
        or a tenant limit or hard budget is reached, 400 for a bad field. Returns the jobs and the
        headers marking a soft budget passed."""
        if priority not in PRIORITIES:
            raise ApiError(400, f"X-Fleet-Priority must be one of {', '.join(PRIORITIES)}, not "
                           f"'{shown(priority)}'", param="X-Fleet-Priority", code="invalid_priority")
        tenant = self.tenant(caller)
        if tenant is not None and PRIORITIES.index(priority) < PRIORITIES.index(tenant.max_priority):
            priority = tenant.max_priority  # the tenant's ceiling
        if not self.live_workers.get(pool):
            await self.refresh()  # a worker may have come up since the last look
            if not self.redis_up:
                raise ApiError(503, "the fleet's Redis is unreachable", code="redis_unavailable")
            if not self.live_workers.get(pool) and not self.cold_start(pool):
                raise ApiError(503, f"no live worker serves pool '{pool}'", code="no_workers")
        self.refuse_too_big(pool)
        fleet = self.fleet_for(pool)
        try:
            depth = await self.queue_depth(pool, priority, caller.tenant, in_use=True)
        except OUTAGE_ERRORS:
            raise ApiError(503, "the fleet's Redis is unreachable", code="redis_unavailable") from None
        limit = self.settings.gateway.max_queue
        if depth + len(requests) > limit:
            raise ApiError(429, f"pool '{pool}' has {depth} jobs waiting at priority {priority} or above "
                           f"(limit {limit}); retry later",
                           code="queue_full", headers={"Retry-After": str(self.settings.gateway.retry_after)})
        ids = [new_job_id() for _ in requests]
        marks = await self.check_budgets(caller, tenant)
        await self._admit(caller.tenant, tenant, ids)
        named = {} if caller.tenant == DEFAULT_TENANT else {"tenant": caller.tenant}
        if caller.key is not None:
            named["key_name"] = caller.key
        jobs: list[AsyncFleetJob] = []
        try:
            for fields, job_id in zip(requests, ids, strict=True):
                job_fields: dict[str, Any] = {**fields, **named, "job_id": job_id}
                jobs.append(await fleet.submit(priority=priority, **job_fields))
        except ValueError as e:
            await self._undo(caller.tenant, tenant, ids, jobs)
            raise ApiError(400, str(e), param=field_named(str(e)), code="invalid_request") from None
        except OUTAGE_ERRORS:
            await self._undo(caller.tenant, tenant, ids, jobs)
            raise ApiError(503, "the fleet's Redis is unreachable", code="redis_unavailable") from None
        if not self.live_workers.get(pool):  # scale from zero: the queued jobs start a worker
            await self.wait_for_worker(pool, jobs)
        return jobs, marks

    def refuse_too_big(self, pool: str) -> None:
        """422 when every live worker serving `pool` says its model could never load there (the
        model needs more than its memory budget less its pinned models): the request would wait
        until its timeout. A worker started later may have room, so with no live worker at all
        (scale from zero) the request waits as before."""
        said = self.cannot_hold.get(pool, [])
        if not said or len(said) < self.live_workers.get(pool, 0):
            return
        need, room = min(s["need_mb"] for s in said), max(s["room_mb"] for s in said)
        raise ApiError(422, f"model '{shown(said[0].get('model'))}' needs ~{need} MB of RAM, more than any "
                       f"live worker serving it can hold: the most one has is {room} MB (its "
                       "memory_budget_mb less its pinned models)", param="model", code="model_too_large")

    def cold_start(self, pool: str) -> bool:
        """Whether a request for `pool` may wait for a worker to start: a catalogue model with
        `cold_start_wait` (its queue's depth is what starts one: `fleet up`, KEDA)."""
        return pool in self.catalogue_pools and self.settings.gateway.cold_start_wait > 0

    async def wait_for_worker(self, pool: str, jobs: list[AsyncFleetJob]) -> None:
        """After enqueueing for a pool no live worker serves: wait up to `cold_start_wait` for
        one; if none comes, the jobs are cancelled (nothing stays queued) and it is a 503."""
        deadline = time.monotonic() + self.settings.gateway.cold_start_wait
        while not self.live_workers.get(pool) and time.monotonic() < deadline:
            await asyncio.sleep(REFRESH_INTERVAL / 4)
            await self.refresh()
        if not self.live_workers.get(pool):
            await cancel_all(jobs)
            raise ApiError(503, f"no worker serving pool '{pool}' started within "
                           f"{self.settings.gateway.cold_start_wait:g}s (gateway.cold_start_wait)",
                           code="no_workers")

    async def check_budgets(self, caller: Caller, tenant: TenantSettings | None) -> dict[str, str]:
        """The one check of a tenant's budgets (and its named key's), for every route that starts
        jobs (and a batch's creation): 429 naming a hard budget reached, with its reset time; the
        headers that mark an answer past a soft one."""
        if tenant is None:
            return {}
        named = tenant.keys.get(caller.key) if caller.key is not None else None
        spenders: Spenders = [(None, tenant.budgets)] + ([(caller.key, named.budgets)] if named else [])
        try:
            return await run_async(self.fleet.redis, budget_plan(caller.tenant, spenders))
        except BudgetReached as e:
            raise ApiError(429, str(e), code="budget_exceeded", param="budget", kind="tokens",
                           headers={"Retry-After": str(e.retry_after)}) from None
        except OUTAGE_ERRORS:
            raise ApiError(503, "the fleet's Redis is unreachable", code="redis_unavailable") from None

    async def _admit(self, name: str, tenant: TenantSettings | None, ids: list[str]) -> None:
        """Reserve the jobs under the tenant's limits (429 naming the limit, OpenAI's shape; 400
        when more jobs are asked at once than a limit ever allows)."""
        limits = tenant_limits(tenant)
        if not limits.any:
            return
        try:
            await run_async(self.fleet.redis, admit_plan(name, ids, limits))
        except NeverAdmitted as e:  # not a 429: a client would retry it for ever
            raise ApiError(400, str(e), param="n", code="invalid_value") from None
        except LimitReached as e:  # OpenAI's rate-limit errors: type "tokens" for token limits
            raise ApiError(429, str(e), code="rate_limit_exceeded", param=e.limit,
                           kind="tokens" if e.limit == "tokens_per_minute" else "requests",
                           headers={"Retry-After": str(e.retry_after)}) from None
        except OUTAGE_ERRORS:
            raise ApiError(503, "the fleet's Redis is unreachable", code="redis_unavailable") from None

    async def _undo(self, name: str, tenant: TenantSettings | None, ids: list[str],
                    jobs: list[AsyncFleetJob]) -> None:
        await cancel_all(jobs)
        if tenant_limits(tenant).any:
            with contextlib.suppress(*OUTAGE_ERRORS):  # else they expire with their reservation
                await run_async(self.fleet.redis, release_plan(name, ids[len(jobs):]))

    async def queue_depth(self, pool: str, priority: str = PRIORITIES[-1], tenant: str | None = None, *,
                          in_use: bool = False) -> int:
        """Jobs waiting that a job at `priority` competes with: its own queue and the higher ones
        (claimed first); for a tenant, its own queues (the claim shares each priority between the
        tenants with work, so others' backlogs never stand in front of it). Lower ones (a batch's
        lines) never delay it, so they do not count. `in_use` (a request for the pool): the same round
        trip marks the pool's model loaded again, should an operator have unloaded it (Ollama's
        /api/ps lists it again)."""
        async with self.fleet.redis.pipeline(transaction=False) as pipe:
            for name in queue_names(pool)[:PRIORITIES.index(priority) + 1]:
                pipe.llen(queue_key(tenant_queue_name(name, tenant)))
            if in_use:
                pipe.hdel(UNLOADED_KEY, pool)
            replies = await pipe.execute()
            return sum(int(n) for n in replies[:len(replies) - in_use])




def tenant_limits(tenant: TenantSettings | None) -> Limits:
    if tenant is None:
        return Limits()
    return Limits(max_concurrent=tenant.max_concurrent, max_queued=tenant.max_queued,
                  requests_per_minute=tenant.requests_per_minute, tokens_per_minute=tenant.tokens_per_minute)


def caller_keys(settings: GatewaySettings) -> list[tuple[bytes, Caller]]:
    """Every accepted key and whose it is. The flat `api_keys` are the default tenant's, and its
    operators' too while neither tenants nor admin keys are configured (as before tenants)."""
    flat_operator = not settings.tenants and not settings.admin_keys
    keys = [(k, Caller(DEFAULT_TENANT, operator=flat_operator)) for k in settings.api_keys]
    keys += [(k, Caller(DEFAULT_TENANT, admin=True, operator=True)) for k in settings.admin_keys]
    keys += [(k, Caller(name, key=key)) for name, t in settings.tenants.items() for k, key in t.all_keys()]
    return [(k.get_secret_value().encode(), caller) for k, caller in keys]


def field_named(message: str) -> str | None:
    """The field a validation message names ("invalid request: temperature: ...")."""
    head = message.removeprefix("invalid request: ").split(":", 1)[0].strip()
    return head.split(".")[0] if head and " " not in head else None


async def cancel_all(jobs: list[AsyncFleetJob]) -> None:
    """Cancel jobs whose client left (queued: removed; running: stopped within a step)."""
    for job in jobs:
        try:
            await job.cancel()
        except OUTAGE_ERRORS as e:
            log.warning("could not cancel job %s: %s", job.id, e)
