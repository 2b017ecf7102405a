"""What RQ's own worker does in its cleanup path and the fleet's worker must do itself (RQ's own
cleanup never runs here, since no RQ worker serves these queues), run by whichever worker holds
the reaper lock, every CLEAN_EVERY seconds:

- trim RQ's registries of ended jobs (rq:finished / rq:failed / rq:canceled:<queue>): their
  scores are expiry times, and without a trim they grow for ever, one member per job;
- end jobs that RQ's own `job.cancel()` took off a queue: RQ writes no final stream entry and no
  TTL, so fleet readers would wait for ever and the hash would stay. Such a job gets a
  `cancelled` final entry and the result TTL, in one script that first checks the job is still
  cancelled, has no final entry and is held by no worker (a held one is ended by its worker).
"""

from __future__ import annotations

import logging
import time

from redis import Redis

from backends.contract import queue as queue_model
from backends.contract.keys import (
    ATTEMPT_FIELD,
    ENDED_REGISTRIES,
    RQ_QUEUES_SET,
    canceled_registry_key,
    job_key,
)
from backends.contract.replies import as_int, as_str
from backends.contract.schema import job_result

log = logging.getLogger("fleet.reaper")
CLEAN_EVERY = 5.0  # seconds
CANCELS_PER_PASS = 1000  # members of one canceled registry looked at per pass (oldest first)



def cancelled_result(job_id: str, attempt: int = 1) -> dict[str, object]:
    """The result of a job cancelled before it ran (the same shape job.result() returns; the
    attempt it would have been, as the script numbers its entry)."""
    return job_result(job_id, "", "cancelled", prompt_tokens=0, completion_tokens=0, worker=None,
                      backend=None, attempt=attempt).model_dump()


class Housekeeper:
    def __init__(self, redis: Redis, queues: list[str], result_ttl: int) -> None:
        self.redis = redis
        self.queues = queues
        self.result_ttl = result_ttl
        self._end_rq_cancel = redis.register_script(queue_model.END_RQ_CANCEL)
        self._next = 0.0

    def run(self, force: bool = False) -> None:
        if not force and time.monotonic() < self._next:
            return
        self._next = time.monotonic() + CLEAN_EVERY
        seconds, _micros = self.redis.time()
        registered = [as_str(k) or "" for k in self.redis.smembers(RQ_QUEUES_SET)]
        for queue in queue_model.with_tenant_queues(self.queues, registered):
            self.end_rq_cancels(queue)
            with self.redis.pipeline(transaction=False) as pipe:
                for prefix in ENDED_REGISTRIES:
                    pipe.zremrangebyscore(prefix + queue, "-inf", seconds)
                pipe.execute()

    def end_rq_cancels(self, queue: str) -> int:
        ended = 0
        for raw in self.redis.zrange(canceled_registry_key(queue), 0, CANCELS_PER_PASS - 1):
            job_id = as_str(raw) or ""
            attempt = as_int(self.redis.hget(job_key(job_id), ATTEMPT_FIELD)) + 1  # as the script counts
            keys, args = queue_model.end_rq_cancel_call(job_id, cancelled_result(job_id, attempt),
                                                        self.result_ttl)
            if self._end_rq_cancel(keys=keys, args=args):
                ended += 1
                log.info("job %s was cancelled with RQ while queued: final entry written", job_id)
        return ended
