"""Recovery of dead workers' jobs. Runs in every worker's heartbeat thread; a Redis lock makes
sure only one worker reaps at a time, and every requeue/failure is itself atomic and checks the
job is still in the dead worker's in-flight list, so a job is never handed back twice.

A worker is dead when its status key fleet:worker:<name> (TTL = 3 heartbeats) is gone. Each job
id in its in-flight list goes back to the FRONT of its queue with attempt + 1, or, once it has
used `max_attempts`, fails with a reason naming the workers that died running it. Delivery is
at-least-once; stream entries carry the attempt, so readers drop a dead attempt's partial text.
A job the dead worker was setting up in a step that could have killed it (SUSPECT_FIELD names
that worker: its grammar, before its first text) fails at once instead: handing it to the next
worker would likely kill that one too. So does a job that has hung POISON_HANGS workers (HUNG_FIELD,
written by the watchdog of each: worker/liveness/watchdog.py): it is poison, not bad luck.

Right after this worker's own Redis connection comes back, it waits one heartbeat TTL before
reaping: the others were cut off too, and their keys may have expired in the meantime.
"""

from __future__ import annotations

import logging

from redis import Redis
from redis.client import Pipeline
from redis.exceptions import ResponseError
from rq.worker_registration import REDIS_WORKER_KEYS, WORKERS_BY_QUEUE_KEY

from backends.contract.keys import (
    ATTEMPT_FIELD,
    DIED_ON_FIELD,
    DRAINS_FIELD,
    EXECUTION_FIELD,
    HUNG_FIELD,
    OWNERS_SET,
    POISON_HANGS,
    REAPER_LOCK,
    SUSPECT_FIELD,
    WORKERS_SET,
    execution_key,
    inflight_key,
    job_key,
    model_copies_key,
    rq_worker_key,
    started_registry_key,
    worker_key,
)
from backends.contract.lua import RELEASE_LOCK
from backends.contract.replies import as_int, as_str
from worker.assembly import job_hooks
from worker.hooks import Holder, Hooks, Restart
from worker.job import Ending, unloaded
from worker.liveness import housekeeping
from worker.redis_link import RedisLink
from worker.serving import endings

log = logging.getLogger("fleet.reaper")
LOCK_MS = 10_000


class Reaper:
    def __init__(self, redis: Redis, me: str, max_attempts: int, result_ttl: int,
                 link: RedisLink | None = None, hold_off: float = 3.0,
                 queues: list[str] | None = None, hooks: Hooks | None = None) -> None:
        self.redis = redis
        self.me = me
        self.max_attempts = max_attempts
        self.result_ttl = result_ttl
        self.link = link
        self.hold_off = hold_off  # seconds after our own reconnect before declaring others dead
        # what a reaped job's restart or failure carries besides its own write (worker/hooks/__init__.py)
        self.hooks = tuple(hooks) if hooks is not None else job_hooks()
        self._requeue = redis.register_script(endings.REQUEUE_LUA)
        self._unlock = redis.register_script(RELEASE_LOCK)
        self.keeper = housekeeping.Housekeeper(redis, queues or [], result_ttl)

    def dead_workers(self) -> list[str]:
        """Workers that registered or claimed (the owners index, written by the claim script) and
        whose status key expired. Never a SCAN of the keyspace: one reap costs the same with 1M
        unrelated keys in Redis."""
        names = {as_str(n) or "" for n in self.redis.sunion([WORKERS_SET, OWNERS_SET])}
        names.discard(self.me)
        return sorted(n for n in names if n and not self.redis.exists(worker_key(n)))

    def reap(self) -> int:
        """Recover every dead worker's jobs. Returns how many jobs were requeued or failed."""
        if self.link is not None and self.link.since_recovery() < self.hold_off:
            return 0
        if not self.redis.set(REAPER_LOCK, self.me, nx=True, px=LOCK_MS):
            return 0
        try:
            n = sum(self.reap_worker(name) for name in self.dead_workers())
            self.keeper.run()  # trims RQ's registries, ends jobs cancelled with RQ while queued
            return n
        finally:
            self._unlock(keys=[REAPER_LOCK], args=[self.me])

    def reap_worker(self, name: str, *, gone: bool = True, why: str | None = None) -> int:
        """Hand back (or fail) every job `name` held; `gone`: it also leaves RQ's worker registry;
        `why`: what happened to it (by default: it died)."""
        inflight = inflight_key(name)
        died = why or _died(name, gone)
        n = 0
        for raw in self.redis.lrange(inflight, 0, -1):
            job_id = as_str(raw) or ""
            fields = ["origin", ATTEMPT_FIELD, DIED_ON_FIELD, DRAINS_FIELD, EXECUTION_FIELD, SUSPECT_FIELD,
                      HUNG_FIELD]
            origin, attempts, died_on, drains, execution, suspect, hung = (
                as_str(v) for v in self._job_fields(job_id, fields))
            used = as_int(attempts) + 1 - as_int(drains)  # drain hand-backs are not failures
            hung_on = [w for w in (hung or "").split(",") if w]
            if origin is None:  # job hash gone (expired/deleted, or an id that is not text)
                self.redis.lrem(inflight, 1, raw)  # type: ignore[arg-type]  # raw bytes as stored
                log.warning("worker %s is dead: dropped %r (no job hash)", name, raw)
            elif used >= self.max_attempts or suspect == name or len(hung_on) >= POISON_HANGS:
                self._end_execution(job_id, origin, execution)
                if len(hung_on) >= POISON_HANGS:
                    self._fail_poison(job_id, origin, name, hung_on, used + as_int(drains))
                elif suspect == name:
                    self._fail_suspect(job_id, origin, name, used, gone, as_int(drains))
                else:
                    self._fail(job_id, origin, name, used, died_on, as_int(drains))
                restart = Restart(job_id, origin, used, died, self.me, reaped=True, requeued=False)
                endings.record_restart(self.redis, self.hooks, restart)
            else:  # the requeue script removes the attempt's RQ execution itself
                attempt = endings.requeue_and_record(self.redis, self._requeue, inflight, job_id, origin,
                                                     died, self.me, self.hooks, died_on=name, reaped=True)
                if attempt >= 0:
                    log.warning("worker %s is dead: requeued %s at the front (attempt %d)", name, job_id,
                                attempt + 1)
            n += 1
        if gone and not self.redis.llen(inflight):
            self.redis.srem(WORKERS_SET, name)
            self.redis.srem(OWNERS_SET, name)
            self._forget_rq_worker(name)
        return n

    def _job_fields(self, job_id: str, fields: list[str]) -> list[object]:
        """The job hash's fields; all None when the key is not a hash (a producer wrote it)."""
        try:
            return list(self.redis.hmget(job_key(job_id), fields))
        except ResponseError:
            return [None] * len(fields)

    def _end_execution(self, job_id: str, origin: str, execution: str | None) -> None:
        """Drop the dead attempt from RQ's wip registry so RQ does not fail it as abandoned later:
        exactly the execution its start recorded (a match on the id as a prefix would also hit
        other jobs whose ids start with this one)."""
        if execution and execution.startswith(job_id + ":"):
            with self.redis.pipeline(transaction=False) as pipe:
                pipe.zrem(started_registry_key(origin), execution)
                pipe.delete(execution_key(execution))
                pipe.hdel(job_key(job_id), EXECUTION_FIELD)
                pipe.execute()

    def _forget_rq_worker(self, name: str) -> None:
        """Keep `rq info` truthful: a dead worker leaves RQ's worker registry now, not in a minute;
        and the models it held (a catalogue worker's copies entries, one per pool it served)."""
        rq_key = rq_worker_key(name)
        queues = (as_str(self.redis.hget(rq_key, "queues")) or "").split(",")
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(rq_key)
            pipe.srem(REDIS_WORKER_KEYS, rq_key)
            for queue in filter(None, queues):
                pipe.srem(WORKERS_BY_QUEUE_KEY % queue, rq_key)
            for pool in {q.rsplit(":", 1)[0] for q in queues if q}:
                pipe.hdel(model_copies_key(pool), name)
            pipe.execute()

    def _fail(self, job_id: str, queue: str, worker: str, used: int, died_on: str | None,
              drains: int = 0) -> None:
        workers = [*filter(None, (died_on or "").split(",")), worker]
        drained = f"; {drains} more runs were handed back by draining workers, not counted" if drains else ""
        reason = (f"gave up after {used} attempts: the worker running it died each time "
                  f"({', '.join(workers)}){drained}; raise max_attempts to retry more")
        self._write_failure(job_id, queue, worker, used + drains, reason)

    def _fail_suspect(self, job_id: str, queue: str, worker: str, used: int, gone: bool,
                      drains: int) -> None:
        who = f"worker {worker}" if gone else f"the previous process named {worker}"
        reason = (f"failed: {who} died while setting up this job's structured output (compiling its "
                  f"grammar or sampling its first token); not retried on another worker, which the same "
                  f"request could crash too")
        self._write_failure(job_id, queue, worker, used + drains, reason)

    def _fail_poison(self, job_id: str, queue: str, worker: str, hung_on: list[str], attempt: int) -> None:
        reason = (f"failed: this job hung {len(hung_on)} workers ({', '.join(hung_on)}): each was stuck in "
                  f"its engine call (its chat template, its prompt or a step) past stall_limit and was "
                  f"restarted; not handed to another worker")
        self._write_failure(job_id, queue, worker, attempt, reason)

    def _write_failure(self, job_id: str, queue: str, worker: str, attempt: int, reason: str) -> None:
        job = unloaded(self.redis, job_id, queue, attempt, Ending(error=reason))
        holder = Holder(worker, "", self.result_ttl)  # the dead worker's backend is not known here

        def write(pipe: Pipeline, _job_id: str) -> None:
            endings.write_ending(job, pipe, holder, self.hooks)

        if endings.commit_held(self.redis, inflight_key(worker), [job_id], write):
            log.warning("job %s: %s", job_id, reason)


def _died(name: str, gone: bool) -> str:
    if gone:
        return f"worker {name} died (its heartbeat expired)"
    return f"the previous process named {name} died while running it"


def recover_own(redis: Redis, name: str, reaper: Reaper) -> int:
    """A worker restarting under its old name first requeues what its previous life held."""
    if redis.llen(inflight_key(name)):
        n = reaper.reap_worker(name, gone=False)
        log.warning("requeued %d jobs left in flight by a previous process named %s", n, name)
        return n
    return 0
