"""Which pools a worker claims from: its own pool (one model for life), or, for a worker serving
catalogue models (backends/shelf.py), each model's pool by what the worker holds.

Model affinity, as prefix placement works for a chat's history: a worker claims first for the
models it has loaded (the most recently used first), up to each one's free slots. A cold model's
jobs (no worker holds it) are claimed by one worker only: the one that takes the model's loading
lock, and only while its memory budget allows the load (evicting idle models if it must). While
some worker holds a model, the others leave its jobs to it; a hot model gets more copies by
pinning it on more workers (`pinned`), not by every idle worker loading it for one burst.

The holders of each model are a zset per pool (backends/contract/keys.py model_holders_key),
refreshed by the holders' claims.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

from redis import Redis

from backends.base import Backend
from backends.contract.keys import (
    MODEL_HOLD_MS,
    MODEL_HOLDERS_TTL,
    MODEL_LOADING_MS,
    UNLOADED_KEY,
    fair_key,
    model_holders_key,
    model_loading_key,
    queue_key,
    queue_names,
    wake_key,
    worker_wake_key,
)
from backends.shelf import ModelShelf
from worker.claiming.claim import Claimer
from worker.settings import FleetSettings

HOLDERS_EVERY = 1.0  # seconds between refreshes of this worker's holder entries
COLD_EVERY = 0.1  # seconds between looks at cold models' queues while this worker is busy


class PoolClaims:
    """A one-model worker: every claim from its pool."""

    def __init__(self, claimer: Claimer, pool: str, name: str) -> None:
        self.claimer = claimer
        self.queues = queue_names(pool)
        self.wake_keys = [wake_key(pool), worker_wake_key(pool, name)]

    def forget(self) -> None:
        pass

    def claim(self, free: int, limits: Sequence[int], held: Counter[str]) -> list[tuple[bytes, str]]:
        return self.claimer.claim(free, limits, held)


class ModelClaims:
    """A catalogue worker's claims, loaded models first (see the module's docstring)."""

    def __init__(self, redis: Redis, claimer: Claimer, shelf: ModelShelf, name: str) -> None:
        self.redis, self.claimer, self.shelf, self.name = redis, claimer, shelf, name
        self.pools = list(shelf.pool_model)
        self.queues = [q for p in self.pools for q in queue_names(p)]
        self.wake_keys = [k for p in self.pools for k in (wake_key(p), worker_wake_key(p, name))]
        self._announced: set[str] = set()  # pools this worker's holder entries name
        self._holders_at = 0.0
        self._cold_at = 0.0

    def claim(self, free: int, limits: Sequence[int], held: Counter[str]) -> list[tuple[bytes, str]]:
        self.shelf.unload_idle()  # the loop claims when idle too: keep_alive holds without jobs
        self._announce()
        out: list[tuple[bytes, str]] = []
        for model in sorted(self.shelf.held.values(), key=lambda m: -m.last_used):
            n = min(self.shelf.free_for(model.pool), free - len(out))
            if n > 0:
                out += self.claimer.claim(n, [min(x, n) for x in limits], held, pool=model.pool)
        now = time.monotonic()
        if len(out) < free and ((not out and not self.shelf.owner) or now >= self._cold_at):
            self._cold_at = now + COLD_EVERY
            out += self._claim_cold(free - len(out), limits, held)
        return out

    def _claim_cold(self, free: int, limits: Sequence[int], held: Counter[str]) -> list[tuple[bytes, str]]:
        """One cold model's jobs, if one has work, no holder, fits, and its loading lock is ours."""
        cold = [p for p in self.pools if not self.shelf.holds(p)]
        if not cold:
            return []
        now_ms = int(time.time() * 1000)
        with self.redis.pipeline(transaction=False) as pipe:
            for pool in cold:
                for queue in queue_names(pool):
                    pipe.llen(queue_key(queue))
                    pipe.zcard(fair_key(queue))
                pipe.zcount(model_holders_key(pool), now_ms, "+inf")
            replies = pipe.execute()
        per = 2 * len(queue_names(cold[0])) + 1
        for i, pool in enumerate(cold):
            counts = replies[i * per:(i + 1) * per]
            waiting, holders = any(counts[:-1]), counts[-1]
            if not waiting or holders or not self.shelf.can_load(self.shelf.pool_model[pool]):
                continue
            if not self.redis.set(model_loading_key(pool), self.name, nx=True, px=MODEL_LOADING_MS):
                continue  # another worker is loading it: its jobs are that worker's
            n = min(free, self.shelf.free_for(pool))
            got = self.claimer.claim(n, [min(x, n) for x in limits], held, pool=pool)
            if got:
                return got
            self.redis.delete(model_loading_key(pool))  # someone took the work meanwhile
        return []

    def _announce(self) -> None:
        """Holder entries for the models held now (refreshed every HOLDERS_EVERY, at once when
        the set changes); a model's loading lock goes once it is loaded."""
        holding = {p for p in self.pools if self.shelf.holds(p)}
        now = time.monotonic()
        if holding == self._announced and now < self._holders_at:
            return
        self._holders_at = now + HOLDERS_EVERY
        if holding:  # an operator's unload (Ollama's keep_alive 0, the router's /models/unload)
            marks = self.redis.hmget(UNLOADED_KEY, sorted(holding))
            for pool, mark in zip(sorted(holding), marks, strict=True):
                if mark is not None:
                    self.shelf.unload_asked(pool, float(mark))
            holding = {p for p in self.pools if self.shelf.holds(p)}
        until = int(time.time() * 1000) + MODEL_HOLD_MS
        with self.redis.pipeline(transaction=False) as pipe:
            for pool in holding:
                pipe.zadd(model_holders_key(pool), {self.name: until})
                pipe.zremrangebyscore(model_holders_key(pool), "-inf", until - 2 * MODEL_HOLD_MS)
                pipe.expire(model_holders_key(pool), MODEL_HOLDERS_TTL)
                if pool not in self._announced:
                    pipe.delete(model_loading_key(pool))
            for pool in self._announced - holding:
                pipe.zrem(model_holders_key(pool), self.name)
            pipe.execute()
        self._announced = holding

    def forget(self) -> None:
        """This worker holds nothing any more (it is stopping)."""
        with self.redis.pipeline(transaction=False) as pipe:
            for pool in self._announced:
                pipe.zrem(model_holders_key(pool), self.name)
            pipe.execute()
        self._announced = set()


def make_claims(redis: Redis, name: str, settings: FleetSettings, backend: Backend
                ) -> PoolClaims | ModelClaims:
    """The claims of a worker over `backend`: a shelf of catalogue models claims by model."""
    pool, weights, slots, placement = (settings.pool, settings.gateway.tenant_weights(), backend.slots,
                                       settings.placement)
    if isinstance(backend, ModelShelf):
        pools = list(backend.pool_model)
        claimer = Claimer(redis, name, [q for p in pools for q in queue_names(p)], weights=weights,
                          slots=slots, pool=pools[0], placement=placement, pools=pools)
        return ModelClaims(redis, claimer, backend, name)
    claimer = Claimer(redis, name, queue_names(pool), weights=weights, slots=slots, pool=pool,
                      placement=placement)
    return PoolClaims(claimer, pool, name)
