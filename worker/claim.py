"""Crash-safe claims, requeues and final writes: who holds a job is the in-flight list it is in.

RQ's own worker pops with BLPOP across queues: a worker that dies right after the pop loses the
job. Here a claim moves job ids from the pool's queues (highest priority first) into the
worker's in-flight list in one script, so at every instant a job id is in exactly one list:
a queue, or a worker's in-flight list (where the reaper finds it if the worker dies).

Every way out of an in-flight list is atomic and checks the id is still there: a requeue (Lua),
and a final result (`commit_held`: MULTI/EXEC under WATCH). So when the reaper takes a job from a
worker it thought dead (say, one cut off from Redis for a while), that worker's late result is
dropped instead of becoming the job's second final result.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from redis import Redis
from redis.client import Pipeline
from redis.commands.core import Script
from redis.exceptions import WatchError

from backends.contract.keys import ATTEMPT_FIELD, DIED_ON_FIELD, inflight_key, job_key, queue_key
from backends.contract.replies import as_str

log = logging.getLogger("fleet.worker")

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

# KEYS: inflight, queue, job hash   ARGV: job id, bump attempt (0/1), attempt field, died-on field,
# name of the dead worker ('' if none)
# Back to the FRONT of its queue (it already waited its turn). Returns the new attempt count
# (or -1 if the id was no longer in flight: someone else requeued or finished it).
_REQUEUE = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return -1 end
redis.call('LPUSH', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[3], 'status', 'queued')
if ARGV[5] ~= '' then
  local before = redis.call('HGET', KEYS[3], ARGV[4])
  redis.call('HSET', KEYS[3], ARGV[4], before and (before .. ',' .. ARGV[5]) or ARGV[5])
end
if ARGV[2] == '1' then return redis.call('HINCRBY', KEYS[3], ARGV[3], 1) end
return tonumber(redis.call('HGET', KEYS[3], ARGV[3]) or '0') or 0
"""

# KEYS: lock   ARGV: owner. Release a lock only if we still own it.
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Contended(Exception):
    """The in-flight list kept changing under a final write; try again on the next flush."""


class Claimer:
    def __init__(self, redis: Redis, worker_name: str, queues: list[str]) -> None:
        self.redis = redis
        self.inflight = inflight_key(worker_name)
        self.queue_keys = [queue_key(q) for q in queues]
        self._claim = redis.register_script(_CLAIM)
        self._requeue = redis.register_script(_REQUEUE)

    def claim(self, n: int) -> list[tuple[bytes, str]]:
        """Up to n (raw job id, queue name) pairs, highest priority first. Ids stay bytes: a
        producer may have pushed one that is not UTF-8, and it must still be failed visibly."""
        if n <= 0:
            return []
        flat = self._claim(keys=[self.inflight, *self.queue_keys], args=[n])
        return [(bytes(flat[i]), flat[i + 1].decode()) for i in range(0, len(flat), 2)]

    def held_raw(self) -> list[bytes]:
        """The ids Redis says this worker holds, as stored (duplicates included)."""
        return [x if isinstance(x, bytes) else x.encode() for x in self.redis.lrange(self.inflight, 0, -1)]

    def drop(self, job_id: str | bytes, pipe: Redis | Pipeline | None = None) -> None:
        """Let go of one entry without a result (a duplicate claim, or a job that already ended)."""
        (pipe or self.redis).lrem(self.inflight, 1, job_id)  # type: ignore[arg-type]

    def requeue(self, job_id: str, queue: str, *, bump_attempt: bool) -> int:
        return requeue(self._requeue, self.inflight, job_id, queue, bump_attempt=bump_attempt)

    def commit_held(self, job_ids: Sequence[str], write: Callable[[Pipeline, str], None]) -> set[str]:
        return commit_held(self.redis, self.inflight, job_ids, write)


def requeue_script(redis: Redis) -> Script:
    return redis.register_script(_REQUEUE)


def unlock_script(redis: Redis) -> Script:
    return redis.register_script(_UNLOCK)


def requeue(script: Script, inflight: str, job_id: str, queue: str, *, bump_attempt: bool,
            died_on: str = "") -> int:
    """Move `job_id` from `inflight` back to the front of `queue`; -1 if it was no longer there.
    `died_on` names a dead worker to remember in the job hash (for the final failure reason)."""
    args: list[Any] = [job_id, "1" if bump_attempt else "0", ATTEMPT_FIELD, DIED_ON_FIELD, died_on]
    return int(script(keys=[inflight, queue_key(queue), job_key(job_id)], args=args))


def commit_held(redis: Redis, inflight: str, job_ids: Sequence[str],
                write: Callable[[Pipeline, str], None], tries: int = 5) -> set[str]:
    """For each id still in `inflight`: queue `write(pipe, id)` and drop the id from the list,
    all in one MULTI/EXEC that applies only if the list did not change meanwhile.
    Returns the ids written; the others were taken away (requeued by a reaper) and get nothing.
    Raises Contended if the list kept changing for `tries` rounds."""
    with redis.pipeline(transaction=True) as pipe:
        for _ in range(tries):
            try:
                pipe.watch(inflight)
                present = {as_str(x) for x in pipe.lrange(inflight, 0, -1)}
                mine = [j for j in dict.fromkeys(job_ids) if j in present]
                pipe.multi()
                for job_id in mine:
                    write(pipe, job_id)
                    pipe.lrem(inflight, 1, job_id)
                replies = pipe.execute(raise_on_error=False)
            except WatchError:
                continue
            log_refusals(replies, f"a final write for {inflight}")
            return set(mine)
    raise Contended(f"{inflight} kept changing during {tries} tries")


def log_refusals(replies: list[Any], what: str) -> None:
    """Commands Redis refused inside an applied MULTI or pipeline (e.g. WRONGTYPE on a tampered
    key): the others applied, so these are reported, not retried."""
    for reply in replies:
        if isinstance(reply, Exception):
            log.warning("%s was partly refused by Redis: %s", what, reply)
