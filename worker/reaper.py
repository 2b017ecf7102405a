"""Recovery of dead workers' jobs. Runs in every worker's heartbeat thread; a Redis lock makes
sure only one worker reaps at a time, so a job is never requeued twice.

A worker is dead when its status key fleet:worker:<name> (TTL = 3 heartbeats) is gone. Each job
id in its in-flight list goes back to the FRONT of its queue with attempt + 1, or, once it has
used `max_attempts`, fails with a reason naming the worker. Delivery is at-least-once; stream
entries carry the attempt, so readers drop a dead attempt's partial text.
"""

from __future__ import annotations

import logging
from typing import Any

from redis import Redis
from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from dispatcher import stream
from dispatcher.keys import ATTEMPT_FIELD, REAPER_LOCK, WORKERS_SET, inflight_key, job_key, stream_key, worker_key
from worker import claim, rqjobs

log = logging.getLogger("fleet.reaper")


class Reaper:
    def __init__(self, redis: Redis, me: str, max_attempts: int, result_ttl: int) -> None:
        self.redis = redis
        self.me = me
        self.max_attempts = max_attempts
        self.result_ttl = result_ttl
        self._requeue = claim.requeue_script(redis)

    def dead_workers(self) -> list[str]:
        names = {n.decode() for n in self.redis.smembers(WORKERS_SET)}
        names |= {k.decode().split(":", 2)[2] for k in self.redis.scan_iter("fleet:inflight:*", count=500)}
        names.discard(self.me)
        return sorted(n for n in names if not self.redis.exists(worker_key(n)))

    def reap(self) -> int:
        """Recover every dead worker's jobs. Returns how many jobs were requeued or failed."""
        if not self.redis.set(REAPER_LOCK, self.me, nx=True, px=10_000):
            return 0
        try:
            return sum(self.reap_worker(name) for name in self.dead_workers())
        finally:
            if self.redis.get(REAPER_LOCK) == self.me.encode():
                self.redis.delete(REAPER_LOCK)

    def reap_worker(self, name: str) -> int:
        inflight = inflight_key(name)
        n = 0
        for raw in self.redis.lrange(inflight, 0, -1):
            job_id = raw.decode()
            origin, attempts = self.redis.hmget(job_key(job_id), ["origin", ATTEMPT_FIELD])
            used = int(attempts or 0) + 1
            self._end_execution(job_id, origin)
            if origin is None:  # job hash gone (expired/deleted): nothing to run
                self.redis.lrem(inflight, 1, job_id)
            elif used >= self.max_attempts:
                self._fail(job_id, origin.decode(), name, used, inflight)
            else:
                attempt = claim.requeue(self._requeue, inflight, job_id, origin.decode(), bump_attempt=True)
                log.warning("worker %s is dead: requeued %s (attempt %d)", name, job_id, attempt + 1)
            n += 1
        if not self.redis.llen(inflight):
            self.redis.srem(WORKERS_SET, name)
        return n

    def _end_execution(self, job_id: str, origin: bytes | None) -> None:
        """Drop the dead attempt from RQ's wip registry so RQ does not fail it as abandoned later."""
        if origin is None:
            return
        key = StartedJobRegistry(origin.decode(), connection=self.redis, serializer=JSONSerializer).key
        for member, _score in self.redis.zscan_iter(key, match=f"{job_id}*"):
            self.redis.zrem(key, member)

    def _fail(self, job_id: str, queue: str, worker: str, used: int, inflight: str) -> None:
        reason = (f"gave up after {used} attempts: the worker running it died each time "
                  f"(last: {worker}); raise max_attempts to retry more")
        log.warning("job %s: %s", job_id, reason)
        claimed = rqjobs.ClaimedJob(job_id, queue, attempt=used)
        try:
            claimed.job = Job.fetch(job_id, connection=self.redis, serializer=JSONSerializer)
        except Exception:
            claimed.job = None
        with self.redis.pipeline(transaction=False) as pipe:
            rqjobs.store_failure(claimed, reason, worker, self.result_ttl, pipe)
            err: dict[str, Any] = rqjobs.error_payload(reason, claimed, worker, "")
            pipe.xadd(stream_key(job_id), stream.encode_error(used, err))
            pipe.expire(stream_key(job_id), self.result_ttl)
            pipe.lrem(inflight, 1, job_id)
            pipe.execute()


def recover_own(redis: Redis, name: str, reaper: Reaper) -> int:
    """A worker restarting under its old name first requeues what its previous life held."""
    if redis.llen(inflight_key(name)):
        n = reaper.reap_worker(name)
        log.warning("requeued %d jobs left in flight by a previous process named %s", n, name)
        return n
    return 0

