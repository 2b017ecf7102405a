"""Crash-safe claims, requeues and final writes: who holds a job is the in-flight list it is in.

RQ's own worker pops with BLPOP across queues: a worker that dies right after the pop loses the
job. Here a claim moves job ids from the pool's queues (highest priority first) into the
worker's in-flight list in one script, so at every instant a job id is in exactly one list:
a queue, or a worker's in-flight list (where the reaper finds it if the worker dies).

The claim script also takes ownership (`fleet_owner` in the job hash, and the worker's name in
the reaper's owners index) in the same step, refusing a second copy of an id someone holds.
Every way out of an in-flight list (a requeue, a final result) and every other write about a
job (its start, its text) checks the id is still there: those writes are in worker/serving/endings.py.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from redis import Redis
from redis.client import Pipeline

from backends.contract.gateway_settings import FairTokens
from backends.contract.keys import (
    ATTEMPT_FIELD,
    FINAL_FIELD,
    OWNER_FIELD,
    OWNERS_SET,
    QUEUE_PREFIX,
    capacity_key,
    fair_key,
    inflight_key,
    queue_key,
    queue_names,
    worker_key,
)
from backends.contract.queue import CLAIM, STARVED, fair
from backends.contract.replies import as_str

log = logging.getLogger("fleet.worker")


FAIR_EVERY = 8  # the claim script's fairness cycle (picks)
# a tenant that ran jobs here this recently still has its share of the slots kept: closed-loop
# users resubmit moments after an answer, and another tenant's backlog must not take their slots
# in between (they would wait for it to give way)
RECENT_SECONDS = 1.0


def tenant_reserve(slots: int) -> int:
    """Slots a lone tenant leaves free, so another tenant's first job starts at once: 1 from 4."""
    return 1 if slots >= 4 else 0


class Claimer:
    def __init__(self, redis: Redis, worker_name: str, queues: list[str],
                 weights: dict[str, float] | None = None, slots: int = 0, pool: str | None = None,
                 placement: bool = True, pools: Sequence[str] = (), store: str = "",
                 tokens: FairTokens | None = None) -> None:
        """`pools`: a worker serving several pools (one per catalogue model) claims from each
        apart (`claim(pool=...)`); `queues` are then all their queues. `store`: the id of the
        KV store this worker reads (backends/llamacpp/kv_store.py), "" for none. `tokens`: what
        a token weighs in the fair share (backends/contract/queue/fair.py)."""
        self.redis = redis
        self.weights = dict(weights or {})  # tenant -> weight, for the claim's fair share
        self.tokens = fair.claim_args(tokens or FairTokens())
        self.placement = placement  # False: claim in queue order, blind to who holds a prefix
        self.store = store  # a busy holder's jobs come here when this worker reads its store
        self.slots = slots  # shared between tenants with work (0: claim order only)
        self.name = worker_name
        self.inflight = inflight_key(worker_name)
        # claim only while this worker's status key exists (a worker process with a heartbeat
        # sets it: see the claim script's header); in-process test workers have no heartbeat
        self.require_live = False
        self.refused = 0  # claims refused because the status key was missing
        self.queue_keys = [queue_key(q) for q in queues]
        # the pool's free capacity: slots 0 (claim order only) neither reads nor writes it
        self.capacity = capacity_key(pool or queues[0].rsplit(":", 1)[0])
        self.by_pool: dict[str, tuple[list[str], str]] = {}
        if pools:
            self.serve(pools)
        self._claim = redis.register_script(CLAIM)
        self._starved = redis.register_script(STARVED)
        self.picks = 0  # jobs claimed so far: where this worker is in the fairness cycle
        self._last_held: dict[str, float] = {}  # tenant -> when it last held a job here (monotonic)
        self.server_ms = 0  # Redis server time of the last claim

    def serve(self, pools: Sequence[str]) -> None:
        """Claim from these pools (one per catalogue model) from now on: the live catalogue changed."""
        self.queue_keys = [queue_key(q) for p in pools for q in queue_names(p)]
        self.by_pool = {p: ([queue_key(q) for q in queue_names(p)], capacity_key(p)) for p in pools}

    def claim(self, n: int, limits: Sequence[int] = (), held: Mapping[str, int] | None = None,
              pool: str | None = None) -> list[tuple[bytes, str]]:
        """Up to n (raw job id, queue name) pairs, highest priority first (but see FAIR_EVERY);
        `limits`: per queue, the most the claim may hold after taking from it; `held`: jobs this
        worker runs, by tenant (their share of the slots). Ids stay bytes: a producer may have
        pushed one that is not UTF-8, and it must still be failed visibly."""
        if n <= 0:
            return []
        args: list[Any] = [n, self.name, self.picks % FAIR_EVERY, OWNER_FIELD, FINAL_FIELD, ATTEMPT_FIELD,
                           "1" if self.require_live else "0", self._share(held), *limits]
        queue_keys, capacity = self.by_pool[pool] if pool is not None else (self.queue_keys, self.capacity)
        keys = [self.inflight, OWNERS_SET, worker_key(self.name), *queue_keys, capacity]
        flat = self._claim(keys=keys, args=args)
        self.server_ms, dropped = int(flat[0]), int(flat[1])
        if dropped < 0:
            if self.refused % 40 == 0:  # every ~10 s of idle polling
                log.warning("not claiming: this worker's status key is missing, so the fleet takes it "
                            "for dead; waiting for the heartbeat to register it again")
            self.refused += 1
            return []
        if dropped:
            log.warning("claim: dropped %d queue entries of jobs already held or ended", dropped)
        pairs = [(bytes(flat[i]), flat[i + 1].decode()) for i in range(2, len(flat), 2)]
        self.picks += len(pairs)
        return pairs

    def _share(self, held: Mapping[str, int] | None) -> str:
        held = {t: n for t, n in (held or {}).items() if n > 0}
        now = time.monotonic()
        for tenant in held:
            self._last_held[tenant] = now
        recent = {t: 1 for t, at in self._last_held.items() if t not in held and now - at < RECENT_SECONDS}
        self._last_held = {t: at for t, at in self._last_held.items() if now - at < RECENT_SECONDS}
        return json.dumps({"w": self.weights, "held": held, "recent": recent, "slots": self.slots,
                           "reserve": tenant_reserve(self.slots), "placement": self.placement,
                           "store": self.store, "tok": self.tokens})

    def starved(self, held: Mapping[str, int]) -> tuple[dict[str, int], dict[str, int]]:
        """On a worker with no free slot: tenants with jobs queued below their share of its slots
        (how many more each may take), and tenants above theirs (by how many)."""
        flat = [as_str(x) or "" if isinstance(x, bytes) else x
                for x in self._starved(keys=self.queue_keys, args=[self._share(held)])]
        cut = flat.index("|")
        return _counts(flat[:cut]), _counts(flat[cut + 1:])

    def nothing_queued(self) -> bool:
        """No job waits in this worker's queues (tenants' included) nor in its in-flight list (a
        claim whose reply was lost). Raises on an outage: the caller cannot tell then."""
        with self.redis.pipeline(transaction=False) as pipe:
            for key in self.queue_keys:
                pipe.llen(key)
                pipe.zcard(fair_key(key.removeprefix(QUEUE_PREFIX)))  # tenants' queues with work
            pipe.llen(self.inflight)
            return not any(pipe.execute())

    def held_raw(self) -> list[bytes]:
        """The ids Redis says this worker holds, as stored (duplicates included)."""
        return [x if isinstance(x, bytes) else x.encode() for x in self.redis.lrange(self.inflight, 0, -1)]

    def drop(self, job_id: str | bytes, pipe: Redis | Pipeline | None = None) -> None:
        """Let go of one entry without a result (a duplicate claim, or a job that already ended)."""
        (pipe or self.redis).lrem(self.inflight, 1, job_id)  # type: ignore[arg-type]


def _counts(flat: list[Any]) -> dict[str, int]:
    """[name, n, name, n, ...] as a dict."""
    return {str(flat[i]): int(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}
