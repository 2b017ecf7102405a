"""Which pools a worker claims from: its own pool (one model for life), or, for a worker serving
catalogue models (backends/shelf.py), each model's pool by what the worker holds.

Model affinity, as prefix placement works for a chat's history: a worker claims first for the
models it has loaded (the most recently used first), up to each one's free slots. A cold model's
jobs (no worker holds it) are claimed by one worker only: the one that takes the model's loading
lock, and only while its memory budget allows the load (evicting idle models if it must). The
lock lives three heartbeat intervals, extended by the loader's heartbeat while the load runs, and
is released at the loader's next claim, when the load is over either way: a load that failed
(its error remembered by the shelf) leaves the model's other jobs to the next claim at once,
which fails them with that error; a loader that died frees the model once it looks dead. While
some worker holds a model with a free slot, the others leave its jobs to it. When every holder is
full (or busy in a long step) and its jobs have waited `second_copy_after` seconds, an idle worker
that may serve it loads another copy, under the same lock: a burst that the holder drains within
a few seconds costs no second load; a model that stays hot gets more copies (as does `pinned` on
more workers).

Who holds each model is a hash per pool (backends/contract/keys.py model_copies_key), written
by the holders' claims: the gateway's `/api/ps` reads it too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from redis import Redis
from redis.client import Pipeline

from backends.base import Backend
from backends.contract.catalogue import live_copies, live_models, model_pools
from backends.contract.keys import (
    CATALOGUE_KEY,
    MODEL_COPIES_TTL,
    MODEL_FETCH_TTL,
    MODEL_HOLD_MS,
    UNLOADED_KEY,
    capacity_key,
    fair_key,
    has_room,
    model_copies_key,
    model_fetch_key,
    model_loading_key,
    queue_key,
    queue_names,
    wake_key,
    worker_wake_key,
)
from backends.contract.lua import EXTEND_LOCK, RELEASE_LOCK, queue_script
from backends.contract.retry import OUTAGE_ERRORS
from backends.llamacpp.kv_store import store_id
from backends.llamacpp_settings import kv_store_section
from backends.shelf import ModelShelf
from worker.claiming.claim import Claimer
from worker.settings import FleetSettings

log = logging.getLogger("fleet.worker")
HOLDERS_EVERY = 1.0  # seconds between refreshes of this worker's holder entries
COLD_EVERY = 0.1  # seconds between looks at cold models' queues while this worker is busy
CATALOGUE_EVERY = 1.0  # seconds between reads of the live catalogue
FETCH_SAID = 0.25  # seconds between writes of a fetch's progress
ROOM_EVERY = 5.0  # seconds between looks at which models could never load here (their files may change)


class PoolClaims:
    """A one-model worker: every claim from its pool."""

    def __init__(self, claimer: Claimer, pool: str, name: str) -> None:
        self.claimer = claimer
        self.queues = queue_names(pool)
        self.wake_keys = [wake_key(pool), worker_wake_key(pool, name)]
        self.cannot_hold: dict[str, dict[str, object]] = {}  # its one model is loaded

    def refresh(self, pipe: Pipeline) -> None:
        pass

    def forget(self) -> None:
        pass

    def claim(self, free: int, limits: Sequence[int], held: Counter[str]) -> list[tuple[bytes, str]]:
        return self.claimer.claim(free, limits, held)


class ModelClaims:
    """A catalogue worker's claims, loaded models first (see the module's docstring)."""

    def __init__(self, redis: Redis, claimer: Claimer, shelf: ModelShelf, name: str,
                 changed: threading.Event, second_copy_after: float = 0.0, lock_ms: int = 3000,
                 settings: FleetSettings | None = None) -> None:
        self.redis, self.claimer, self.shelf, self.name = redis, claimer, shelf, name
        self.settings = settings  # its catalogue and serve_models: the live catalogue over them
        self._catalogue_raw: dict[Any, Any] | None = {}  # at start: the config's catalogue alone
        self._catalogue_at = 0.0
        self._fetch_said = 0.0
        shelf.on_fetch = self._fetching
        self.changed = changed
        self.second_copy_after = second_copy_after
        self.lock_ms = lock_ms  # a loading lock's life: as long as a silent worker is taken for alive
        self._loading: set[str] = set()  # pools whose loading lock this worker took (their loads)
        # pool -> why its model could never load here (ModelShelf.cannot_hold), in the worker's status
        self.cannot_hold = shelf.cannot_hold()
        self._room_at = time.monotonic() + ROOM_EVERY
        self._full_since: dict[str, float] = {}  # pool -> since when its holders were seen full
        self.pools = list(shelf.pool_model)
        self.queues = [q for p in self.pools for q in queue_names(p)]
        self.wake_keys = [k for p in self.pools for k in (wake_key(p), worker_wake_key(p, name))]
        self._announced: dict[str, tuple[float, float]] = {}  # pool -> (loaded at, keep_alive) announced
        self._holders_at = 0.0
        self._cold_at = 0.0
        self._too_big: set[str] = set()  # models this worker can never load (warned)

    def claim(self, free: int, limits: Sequence[int], held: Counter[str]) -> list[tuple[bytes, str]]:
        self.shelf.unload_idle()  # the loop claims when idle too: keep_alive holds without jobs
        self._follow_catalogue()
        self._announce()
        out: list[tuple[bytes, str]] = []
        for model in sorted(self.shelf.held.values(), key=lambda m: -m.last_used):
            n = min(self.shelf.free_for(model.pool), free - len(out))
            if n > 0:
                out += self.claimer.claim(n, [min(x, n) for x in limits], held, pool=model.pool)
        now = time.monotonic()
        if now >= self._room_at:
            self._room_at = now + ROOM_EVERY
            self.cannot_hold = self.shelf.cannot_hold()
        if len(out) < free and ((not out and not self.shelf.owner) or now >= self._cold_at):
            self._cold_at = now + COLD_EVERY
            out += self._claim_cold(free - len(out), limits, held)
        return out

    def _follow_catalogue(self) -> None:
        """Every CATALOGUE_EVERY: the live catalogue (CATALOGUE_KEY) over the config's, served
        from now on (the models this worker may serve: all, or those `serve_models` names)."""
        now = time.monotonic()
        if self.settings is None or now < self._catalogue_at:
            return
        self._catalogue_at = now + CATALOGUE_EVERY
        raw = self.redis.hgetall(CATALOGUE_KEY)
        if raw == self._catalogue_raw:
            return
        s = self.settings
        models = live_models(s.models, raw, s.models_dir())
        served = {n: e for n, e in models.items() if s.serve_models is None or n in s.serve_models}
        pools = model_pools(served)
        kept = self.shelf.adopt(served, pools)
        self._catalogue_raw = None if kept else raw  # a model with running jobs goes later
        self.pools[:] = list(self.shelf.pool_model)  # in place: the status and the loop hold these lists
        self.queues[:] = [q for p in self.pools for q in queue_names(p)]
        # with no model left, a key nobody pushes to: the idle wait (BLPOP) needs one
        self.wake_keys[:] = ([k for p in self.pools for k in (wake_key(p), worker_wake_key(p, self.name))]
                             or [worker_wake_key(s.pool, self.name)])
        self.claimer.serve(self.pools)
        self.cannot_hold = self.shelf.cannot_hold()
        self.changed.set()
        log.info("catalogue changed: serving %s", ", ".join(self.shelf.entries) or "no model")

    def _fetching(self, model: str, done: int, total: int) -> None:
        """A fetch's progress, for a pull to stream (at most every FETCH_SAID seconds, and its end)."""
        now = time.monotonic()
        if now - self._fetch_said < FETCH_SAID and done != total:
            return
        self._fetch_said = now
        key = model_fetch_key(self.shelf.entries[model].pool_of(model))
        # only a view of the fetch: Redis away must not cut the transfer
        with contextlib.suppress(*OUTAGE_ERRORS), self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, mapping={"completed": done, "total": total, "worker": self.name})
            pipe.expire(key, MODEL_FETCH_TTL)
            pipe.execute()

    def _claim_cold(self, free: int, limits: Sequence[int], held: Counter[str]) -> list[tuple[bytes, str]]:
        """One cold model's jobs, if one has work, no holder, fits, and its loading lock is ours."""
        cold = [p for p in self.pools if not self.shelf.holds(p)]
        if not cold:
            return []
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.time()
            for pool in cold:
                for queue in queue_names(pool):
                    pipe.llen(queue_key(queue))
                    pipe.zcard(fair_key(queue))
                pipe.hgetall(capacity_key(pool))
                pipe.hgetall(model_copies_key(pool))
            replies = pipe.execute()
        sec, usec = replies.pop(0)
        server_ms, now = sec * 1000 + usec // 1000, time.monotonic()
        per = 2 * len(queue_names(cold[0])) + 2
        for i, pool in enumerate(cold):
            counts = replies[i * per:(i + 1) * per]
            # this worker's own entry, should a beat have raced an unload, is no holder
            holders = {w for w in live_copies(counts[-1]) if w != self.name}
            waiting = any(counts[:-2])
            if self._left_to_holders(pool, waiting, holders, counts[-2], server_ms, now):
                continue
            model = self.shelf.pool_model[pool]
            if waiting and model not in self._too_big and not self.shelf.fits(model):
                self._too_big.add(model)  # said once: its jobs wait for a worker with room for it
                log.warning("model %s needs ~%d MB, more than this worker's budget (%d MB) leaves beside its "
                            "pinned models: its jobs are left to other workers", model,
                            self.shelf.need_mb(model), self.shelf.budget_mb)
            if not waiting or not self.shelf.can_load(model):
                continue
            if not self.redis.set(model_loading_key(pool), self.name, nx=True, px=self.lock_ms):
                continue  # another worker is loading it: its jobs are that worker's
            self._loading.add(pool)
            n = min(free, self.shelf.free_for(pool))
            got = self.claimer.claim(n, [min(x, n) for x in limits], held, pool=pool)
            if got:
                self._full_since.pop(pool, None)
                return got
            self._release(self.redis, pool)  # someone took the work meanwhile
        return []

    def _release(self, pipe: Pipeline | Redis, pool: str) -> None:
        """Let go of the pool's loading lock, if it is still this worker's."""
        self._loading.discard(pool)
        queue_script(pipe, RELEASE_LOCK, [model_loading_key(pool)], [self.name])

    def _left_to_holders(self, pool: str, waiting: bool, holders: set[str], capacity: dict[bytes, bytes],
                         server_ms: int, now: float) -> bool:
        """Whether the pool's jobs are its holders' (no holder: whoever loads it): unless this
        worker is idle and they have waited second_copy_after with no holder that has a free slot."""
        if (not holders or not waiting or self.shelf.owner or not self.second_copy_after
                or any(has_room(capacity.get(w.encode()), server_ms) for w in holders)):
            self._full_since.pop(pool, None)
            return bool(holders)
        return now - self._full_since.setdefault(pool, now) < self.second_copy_after

    def _announce(self) -> None:
        """When what this worker holds changes: its copies entries (the heartbeat refreshes them
        in between). Its loading locks released: the loop starts the jobs it claimed (loading
        their model) before it claims again, so each load they were taken for is over, its model
        held (the copies entry, written first, says so) or not (failed, or no job needed it).
        Every HOLDERS_EVERY: an operator's unload marks acted on."""
        now = time.monotonic()
        if self.shelf.held and now >= self._holders_at:
            self._holders_at = now + HOLDERS_EVERY
            pools = sorted(m.pool for m in self.shelf.held.values())
            for pool, mark in zip(pools, self.redis.hmget(UNLOADED_KEY, pools), strict=True):
                if mark is not None:  # Ollama's keep_alive 0, the router's /models/unload
                    self.shelf.unload_asked(pool, float(mark))
        state = {m.pool: (m.loaded_at, m.keep_alive) for m in self.shelf.held.values()}
        if state == self._announced and not self._loading:
            return
        with self.redis.pipeline(transaction=False) as pipe:
            self.refresh(pipe)
            for pool in list(self._loading):
                self._release(pipe, pool)
            for pool in set(self._announced) - set(state):
                pipe.hdel(model_copies_key(pool), self.name)
            pipe.execute()
        if set(state) != set(self._announced):
            self.changed.set()  # `fleet status` shows the change at once
        self._announced = state

    def refresh(self, pipe: Pipeline) -> None:
        """Queue this worker's entries for the models it holds now, good for MODEL_HOLD_MS: the
        loop's claims on a change, and every beat the heartbeat, so a worker busy with a full
        engine (which claims nothing) still says it holds its models. Its loading locks: one
        whose model is now held (its entry just written) is released, as a full worker may not
        claim again for long; the others live on while this worker beats."""
        until, now = int(time.time() * 1000) + MODEL_HOLD_MS, time.monotonic()
        for model in list(self.shelf.held.values()):  # the loop may load or unload meanwhile
            entry = {**self.shelf.described(model, now), "until": until}
            pipe.hset(model_copies_key(model.pool), self.name, json.dumps(entry))
            pipe.expire(model_copies_key(model.pool), MODEL_COPIES_TTL)
        for pool in list(self._loading):
            if self.shelf.holds(pool):
                queue_script(pipe, RELEASE_LOCK, [model_loading_key(pool)], [self.name])
            else:
                queue_script(pipe, EXTEND_LOCK, [model_loading_key(pool)], [self.name, self.lock_ms])

    def forget(self) -> None:
        """This worker holds nothing any more (it is stopping, or leaving hung): its copies entries,
        and a loading lock it still holds (a model it loaded and never claimed for again: the
        loop got stuck in that model's first job), so the model's jobs are not left waiting
        MODEL_LOADING_MS for it."""
        with self.redis.pipeline(transaction=False) as pipe:
            for pool in self._announced:
                pipe.hdel(model_copies_key(pool), self.name)
            for pool in self.pools:  # any lock still this worker's, not only one it knows it took
                self._release(pipe, pool)
            pipe.execute()
        self._announced = {}


def make_claims(redis: Redis, name: str, settings: FleetSettings, backend: Backend,
                changed: threading.Event | None = None) -> PoolClaims | ModelClaims:
    """The claims of a worker over `backend`: a shelf of catalogue models claims by model;
    `changed` is set when the models it holds change (the heartbeat then writes the status)."""
    pool, weights, slots, placement = (settings.pool, settings.gateway.tenant_weights(), backend.slots,
                                       settings.placement)
    store = kv_store_of(settings)
    if isinstance(backend, ModelShelf):
        pools = list(backend.pool_model)
        claimer = Claimer(redis, name, [q for p in pools for q in queue_names(p)], weights=weights,
                          slots=slots, pool=pools[0], placement=placement, pools=pools, store=store,
                          tokens=settings.gateway.fair_tokens)
        return ModelClaims(redis, claimer, backend, name, changed or threading.Event(),
                           settings.second_copy_after, lock_ms=int(settings.silent_for_dead * 1000),
                           settings=settings)
    claimer = Claimer(redis, name, queue_names(pool), weights=weights, slots=slots, pool=pool,
                      placement=placement, store=store, tokens=settings.gateway.fair_tokens)
    return PoolClaims(claimer, pool, name)


def kv_store_of(settings: FleetSettings) -> str:
    """The id of the KV store this worker's engine reads and writes, "" for none: an engine with
    one KV stream per slot and `kv_store.path` set (backends/llamacpp/engine.py opens the same)."""
    cfg = kv_store_section(settings.backend)
    if cfg is None or cfg.path is None:
        return ""
    try:
        return store_id(cfg.path)
    except OSError as e:
        log.warning("KV store %s: no id (%s); jobs of busy holders are not sent here", cfg.path, e)
        return ""
