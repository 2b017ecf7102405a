"""Crash-safe claims, requeues and final writes: who holds a job is the in-flight list it is in.

RQ's own worker pops with BLPOP across queues: a worker that dies right after the pop loses the
job. Here a claim moves job ids from the pool's queues (highest priority first) into the
worker's in-flight list in one script, so at every instant a job id is in exactly one list:
a queue, or a worker's in-flight list (where the reaper finds it if the worker dies).

The claim script also takes ownership (`fleet_owner` in the job hash, and the worker's name in
the reaper's owners index) in the same step, refusing a second copy of an id someone holds.
Every way out of an in-flight list is atomic and checks the id is still there: a requeue (Lua),
and a final result (`commit_held`: MULTI/EXEC under WATCH); so is every other write about a job
(its start, its text). So when the reaper takes a job from a worker it thought dead (say, one cut
off from Redis for a while), nothing that worker writes about it lands: not its status, not its
text, not a second final result.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from redis import Redis
from redis.client import Pipeline
from redis.commands.core import Script
from redis.exceptions import ResponseError, WatchError

from dispatcher.keys import (
    ATTEMPT_FIELD,
    DRAINS_FIELD,
    EXECUTION_FIELD,
    FINAL_FIELD,
    OWNER_FIELD,
    OWNERS_SET,
    inflight_key,
    job_key,
    queue_key,
)
from dispatcher.replies import as_str

log = logging.getLogger("fleet.worker")

DIED_ON_FIELD = "fleet_died_on"  # job hash: workers that died running it, comma-separated

# Ownership is taken here, in the same script that moves the id, so two workers can never both
# start one id (issue 10, defect 3): an id whose job hash names a live holder (its owner's
# in-flight list has it) is a second copy and is dropped; so is a leftover copy of a job that
# already ended. A job re-run by RQ's own tools (`rq requeue`: status queued, but its attempt
# already got a final entry) gets a new attempt number, so readers void the old ending (defect 4).
# Fairness (defect 11): of every 8 picks, the 4th starts at the second queue (default) and the
# 8th at the last one (low), so lower priorities move under sustained high-priority load.
# KEYS: inflight, owners set, queue1..queueN (priority order)
# ARGV: max jobs, worker name, pick counter, owner field, final field, attempt field, then optionally
# per queue the most jobs the claim may hold once it took from that queue (worker/priority.py)
# returns: server time (ms), ids dropped, then id1, queue1, id2, queue2, ...
_CLAIM = """
local n, me, pick = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local t = redis.call('TIME')
local out = {t[1] * 1000 + math.floor(t[2] / 1000), 0}
local nq = #KEYS - 2
local ended = {finished = true, failed = true, stopped = true, canceled = true}
local function order(p)
  local first = 1
  if nq >= 2 and p % 8 == 3 then first = 2 elseif nq >= 3 and p % 8 == 7 then first = nq end
  local o = {}
  for i = 0, nq - 1 do o[#o + 1] = 2 + ((first - 1 + i) % nq) + 1 end
  return o
end
local function pop(p, claimed)
  for _, k in ipairs(order(p)) do
    if claimed < tonumber(ARGV[4 + k] or ARGV[1]) then
      local id = redis.call('LPOP', KEYS[k])
      if id then return id, string.sub(KEYS[k], 10) end  -- strip 'rq:queue:'
    end
  end
  return nil, nil
end
local claimed, looked = 0, 0
while claimed < n and looked < n + 256 do
  local id, queue = pop(pick, claimed)
  if not id then break end
  looked = looked + 1
  local key = 'rq:job:' .. id
  local keep = true
  if redis.call('TYPE', key).ok == 'hash' then
    local f = redis.call('HMGET', key, 'status', ARGV[4], ARGV[5], ARGV[6])
    local status, owner, final = f[1], f[2], f[3]
    if owner and owner ~= '' and redis.call('LPOS', 'fleet:inflight:' .. owner, id) then
      keep = false  -- held by a worker (maybe this one): a second copy
    elseif status and ended[status] then
      keep = false  -- a leftover copy of a job that ended
    else
      local before = tonumber(f[4] or '0')
      if final and before and tonumber(final) and tonumber(final) >= before + 1 then
        redis.call('HINCRBY', key, ARGV[6], 1)  -- re-run of an ended attempt: a new number
        redis.call('PERSIST', key)
        redis.call('PERSIST', 'fleet:stream:' .. id)
      end
      redis.call('HSET', key, ARGV[4], me)
    end
  end
  if keep then
    redis.call('RPUSH', KEYS[1], id)
    out[#out + 1] = id
    out[#out + 1] = queue
    claimed = claimed + 1
    pick = pick + 1
  else
    out[2] = out[2] + 1
  end
end
if claimed > 0 then redis.call('SADD', KEYS[2], me) end
return out
"""

# KEYS: inflight, queue, job hash, wip registry of the queue
# ARGV: job id, bump attempt (0/1), attempt field, died-on field, name of the dead worker ('' if
# none), owner field, drains field, counted (0: a drain hand-back, not a failure), execution field
# Back to the FRONT of its queue (it already waited its turn), owner cleared and the attempt's RQ
# execution removed in the same step (defect 5). Returns the new attempt count (or -1 if the id
# was no longer in flight: someone else requeued or finished it).
_REQUEUE = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return -1 end
redis.call('LPUSH', KEYS[2], ARGV[1])
if redis.call('TYPE', KEYS[3]).ok ~= 'hash' then return 0 end
redis.call('HSET', KEYS[3], 'status', 'queued')
redis.call('HDEL', KEYS[3], ARGV[6])
local ex = redis.call('HGET', KEYS[3], ARGV[9])
if ex then
  redis.call('ZREM', KEYS[4], ex)
  redis.call('DEL', 'rq:execution:' .. ex)
  redis.call('ZREM', 'rq:executions:' .. ARGV[1], string.sub(ex, #ARGV[1] + 2))
  redis.call('HDEL', KEYS[3], ARGV[9])
end
if ARGV[5] ~= '' then
  local before = redis.call('HGET', KEYS[3], ARGV[4])
  redis.call('HSET', KEYS[3], ARGV[4], before and (before .. ',' .. ARGV[5]) or ARGV[5])
end
if ARGV[2] == '1' then
  if ARGV[8] == '0' then redis.call('HINCRBY', KEYS[3], ARGV[7], 1) end
  return redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
end
return tonumber(redis.call('HGET', KEYS[3], ARGV[3]) or '0') or 0
"""

# Text deltas (and a restart's new attempt number) are written only while this worker owns the
# job (defect 10); the attempt number only ever goes up.
# KEYS: job hash, stream   ARGV: worker name, owner field, attempt field, attempt, first index,
# maxlen, text1, text2, ...   Returns how many deltas were written, or -1 (not the owner).
_WRITE_TEXT = """
if redis.call('HGET', KEYS[1], ARGV[2]) ~= ARGV[1] then return -1 end
local attempt = tonumber(ARGV[4])
local stored = tonumber(redis.call('HGET', KEYS[1], ARGV[3]) or '0') or 0
if stored < attempt - 1 then redis.call('HSET', KEYS[1], ARGV[3], attempt - 1) end
local seq = tonumber(ARGV[5])
for i = 7, #ARGV do
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'a', attempt, 'k', 't', 'n', seq, 'v', ARGV[i])
  seq = seq + 1
end
return #ARGV - 6
"""

# KEYS: lock   ARGV: owner. Release a lock only if we still own it.
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Contended(Exception):
    """The in-flight list kept changing under a final write; try again on the next flush."""


class NotHeld(Exception):
    """The job is no longer in this worker's in-flight list (the reaper took it)."""


FAIR_EVERY = 8  # the claim script's fairness cycle (picks)


class Claimer:
    def __init__(self, redis: Redis, worker_name: str, queues: list[str]) -> None:
        self.redis = redis
        self.name = worker_name
        self.inflight = inflight_key(worker_name)
        self.queue_keys = [queue_key(q) for q in queues]
        self._claim = redis.register_script(_CLAIM)
        self._requeue = redis.register_script(_REQUEUE)
        self._write_text = redis.register_script(_WRITE_TEXT)
        self.picks = 0  # jobs claimed so far: where this worker is in the fairness cycle
        self.server_ms = 0  # Redis server time of the last claim

    def claim(self, n: int, limits: Sequence[int] = ()) -> list[tuple[bytes, str]]:
        """Up to n (raw job id, queue name) pairs, highest priority first (but see FAIR_EVERY);
        `limits`: per queue, the most the claim may hold after taking from it. Ids stay bytes: a
        producer may have pushed one that is not UTF-8, and it must still be failed visibly."""
        if n <= 0:
            return []
        args: list[Any] = [n, self.name, self.picks % FAIR_EVERY, OWNER_FIELD, FINAL_FIELD, ATTEMPT_FIELD,
                           *limits]
        flat = self._claim(keys=[self.inflight, OWNERS_SET, *self.queue_keys], args=args)
        self.server_ms, dropped = int(flat[0]), int(flat[1])
        if dropped:
            log.warning("claim: dropped %d queue entries of jobs already held or ended", dropped)
        pairs = [(bytes(flat[i]), flat[i + 1].decode()) for i in range(2, len(flat), 2)]
        self.picks += len(pairs)
        return pairs

    def held_raw(self) -> list[bytes]:
        """The ids Redis says this worker holds, as stored (duplicates included)."""
        return [x if isinstance(x, bytes) else x.encode() for x in self.redis.lrange(self.inflight, 0, -1)]

    def drop(self, job_id: str | bytes, pipe: Redis | Pipeline | None = None) -> None:
        """Let go of one entry without a result (a duplicate claim, or a job that already ended)."""
        (pipe or self.redis).lrem(self.inflight, 1, job_id)  # type: ignore[arg-type]

    def requeue(self, job_id: str, queue: str, *, bump_attempt: bool, counted: bool = True) -> int:
        return requeue(self._requeue, self.inflight, job_id, queue, bump_attempt=bump_attempt,
                       counted=counted)

    def text_writer(self) -> Script:
        return self._write_text

    def commit_held(self, job_ids: Sequence[str], write: Callable[[Pipeline, str], None],
                    release: bool = True, seen: Callable[[str, str | None], None] | None = None) -> set[str]:
        return commit_held(self.redis, self.inflight, job_ids, write, release=release, seen=seen)


def requeue_script(redis: Redis) -> Script:
    return redis.register_script(_REQUEUE)


def unlock_script(redis: Redis) -> Script:
    return redis.register_script(_UNLOCK)


def requeue(script: Script, inflight: str, job_id: str, queue: str, *, bump_attempt: bool,
            died_on: str = "", counted: bool = True) -> int:
    """Move `job_id` from `inflight` back to the front of `queue`; -1 if it was no longer there.
    `died_on` names a dead worker to remember in the job hash (for the final failure reason);
    `counted=False`: a drain hand-back, which does not use up one of the job's max_attempts."""
    args: list[Any] = [job_id, "1" if bump_attempt else "0", ATTEMPT_FIELD, DIED_ON_FIELD, died_on,
                       OWNER_FIELD, DRAINS_FIELD, "1" if counted else "0", EXECUTION_FIELD]
    keys = [inflight, queue_key(queue), job_key(job_id), wip_key(queue)]
    return int(script(keys=keys, args=args))


def wip_key(queue: str) -> str:
    """RQ's started registry of a queue (members: <job id>:<execution id>)."""
    return f"rq:wip:{queue}"


def commit_held(redis: Redis, inflight: str, job_ids: Sequence[str],
                write: Callable[[Pipeline, str], None], tries: int = 5, release: bool = True,
                seen: Callable[[str, str | None], None] | None = None) -> set[str]:
    """For each id still in `inflight`: queue `write(pipe, id)` (and, with `release`, drop the id
    from the list and clear its owner), all in one MULTI/EXEC that applies only if the list did
    not change meanwhile. Returns the ids written; the others were taken away (requeued by a
    reaper) and get nothing. Raises Contended if the list kept changing for `tries` rounds.
    `seen(id, status)`: the job hashes are watched too, and each one's RQ status is reported
    before its write is queued (so RQ's job.cancel() cannot slip in between: defect 4)."""
    with redis.pipeline(transaction=True) as pipe:
        for _ in range(tries):
            try:
                pipe.watch(inflight)
                present = {as_str(x) for x in pipe.lrange(inflight, 0, -1)}
                mine = [j for j in dict.fromkeys(job_ids) if j in present]
                if seen is not None and mine:
                    pipe.watch(*(job_key(j) for j in mine))
                    for job_id in mine:
                        seen(job_id, as_str(_status_of(pipe, job_id)))
                pipe.multi()
                for job_id in mine:
                    write(pipe, job_id)
                    if release:
                        pipe.lrem(inflight, 1, job_id)
                        pipe.hdel(job_key(job_id), OWNER_FIELD)
                replies = pipe.execute(raise_on_error=False)
            except WatchError:
                continue
            log_refusals(replies, f"a write for {inflight}")
            return set(mine)
    raise Contended(f"{inflight} kept changing during {tries} tries")


def _status_of(pipe: Pipeline, job_id: str) -> Any:
    try:
        return pipe.hget(job_key(job_id), "status")
    except ResponseError:  # not a hash: the write records the failure plainly
        return None


def log_refusals(replies: list[Any], what: str) -> None:
    """Commands Redis refused inside an applied MULTI or pipeline (e.g. WRONGTYPE on a tampered
    key): the others applied, so these are reported, not retried."""
    for reply in replies:
        if isinstance(reply, Exception):
            log.warning("%s was partly refused by Redis: %s", what, reply)
