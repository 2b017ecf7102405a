"""Crash-safe claims, requeues and final writes: who holds a job is the in-flight list it is in.

RQ's own worker pops with BLPOP across queues: a worker that dies right after the pop loses the
job. Here a claim moves job ids from the pool's queues (highest priority first) into the
worker's in-flight list in one script, so at every instant a job id is in exactly one list:
a queue, or a worker's in-flight list (where the reaper finds it if the worker dies).

The claim script also takes ownership (`fleet_owner` in the job hash, and the worker's name in
the reaper's owners index) in the same step, refusing a second copy of an id someone holds.
Every way out of an in-flight list (a requeue, a final result) and every other write about a
job (its start, its text) checks the id is still there: those writes are in worker/endings.py.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from redis import Redis
from redis.client import Pipeline

from backends.contract.keys import (
    ATTEMPT_FIELD,
    FINAL_FIELD,
    OWNER_FIELD,
    OWNERS_SET,
    inflight_key,
    queue_key,
)

log = logging.getLogger("fleet.worker")


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

FAIR_EVERY = 8  # the claim script's fairness cycle (picks)


class Claimer:
    def __init__(self, redis: Redis, worker_name: str, queues: list[str]) -> None:
        self.redis = redis
        self.name = worker_name
        self.inflight = inflight_key(worker_name)
        self.queue_keys = [queue_key(q) for q in queues]
        self._claim = redis.register_script(_CLAIM)
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
