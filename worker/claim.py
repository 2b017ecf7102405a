"""Crash-safe claims and requeues, each one atomic Lua script.

RQ's own worker pops with BLPOP across queues: a worker that dies right after the pop loses the
job. Here a claim moves job ids from the pool's queues (highest priority first) into the
worker's in-flight list in one script, so at every instant a job id is in exactly one list:
a queue, or a worker's in-flight list (where the reaper finds it if the worker dies).
"""

from __future__ import annotations

from redis import Redis

from dispatcher.keys import ATTEMPT_FIELD, inflight_key, job_key, queue_key

# KEYS: inflight, queue1..queueN (priority order)   ARGV: max jobs
# returns a flat list: id1, queue1, id2, queue2, ...
_CLAIM = """
local out = {}
local n = tonumber(ARGV[1])
for i = 2, #KEYS do
  while #out < 2 * n do
    local id = redis.call('LMOVE', KEYS[i], KEYS[1], 'LEFT', 'RIGHT')
    if not id then break end
    out[#out + 1] = id
    out[#out + 1] = string.sub(KEYS[i], 10)  -- strip 'rq:queue:'
  end
  if #out >= 2 * n then break end
end
return out
"""

# KEYS: inflight, queue, job hash   ARGV: job id, bump attempt (0/1)
# Back to the FRONT of its queue (it already waited its turn). Returns the new attempt count
# (or -1 if the id was no longer in flight: someone else requeued or finished it).
_REQUEUE = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return -1 end
redis.call('LPUSH', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[3], 'status', 'queued')
if ARGV[2] == '1' then return redis.call('HINCRBY', KEYS[3], ARGV[3], 1) end
return tonumber(redis.call('HGET', KEYS[3], ARGV[3]) or '0')
"""


class Claimer:
    def __init__(self, redis: Redis, worker_name: str, queues: list[str]) -> None:
        self.redis = redis
        self.inflight = inflight_key(worker_name)
        self.queue_keys = [queue_key(q) for q in queues]
        self._claim = redis.register_script(_CLAIM)
        self._requeue = redis.register_script(_REQUEUE)

    def claim(self, n: int) -> list[tuple[str, str]]:
        """Up to n (job_id, queue_name) pairs, highest priority first."""
        if n <= 0:
            return []
        flat = self._claim(keys=[self.inflight, *self.queue_keys], args=[n])
        ids = [x.decode() for x in flat]
        return list(zip(ids[0::2], ids[1::2], strict=True))

    def release(self, job_id: str, pipe: Redis | None = None) -> None:
        """The job is finished (result stored in the same pipeline): drop it from in-flight."""
        (pipe or self.redis).lrem(self.inflight, 1, job_id)

    def requeue(self, job_id: str, queue: str, *, bump_attempt: bool) -> int:
        return requeue(self._requeue, self.inflight, job_id, queue, bump_attempt=bump_attempt)


def requeue_script(redis: Redis):  # type: ignore[no-untyped-def]
    return redis.register_script(_REQUEUE)


def requeue(script, inflight: str, job_id: str, queue: str, *, bump_attempt: bool) -> int:  # type: ignore[no-untyped-def]
    return int(
        script(
            keys=[inflight, queue_key(queue), job_key(job_id)],
            args=[job_id, "1" if bump_attempt else "0", ATTEMPT_FIELD],
        )
    )
