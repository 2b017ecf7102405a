-- requeue: a job an in-flight list holds goes back to the FRONT of the queue it came from (it
-- already waited its turn) for another attempt, or as it was (a claimed job that never started).
-- Every path takes it: a worker's hand-back (engine failure, drain, outage buffer, preemption)
-- and the reaper's recovery of a dead worker's jobs.
-- KEYS: inflight, job hash
-- ARGV: job id, bump attempt (0/1), name of the dead worker ('' if none), counted (0: a drain
-- hand-back, not a failure), the queue to use when the job hash names none (or a name that is
-- no fleet queue: a producer wrote it)
-- Where it goes is the job's own origin (a tenant's job: its tenant's queue, the tenant listed in
-- the fair share again); owner cleared and the attempt's RQ execution removed in the same step
-- (so a lost reply leaves none). Returns the new attempt count, or -1 if the id was no longer in
-- flight (someone else requeued or finished it).
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return -1 end
local origin = origin_of(KEYS[2])
local queue = origin
if queue == nil or (ARGV[5] ~= '' and not is_fleet_queue(queue)) then queue = ARGV[5] end
push_front(queue, ARGV[1])
if origin == nil then return 0 end
redis.call('HSET', KEYS[2], 'status', 'queued')
redis.call('HDEL', KEYS[2], FIELD.owner, FIELD.suspect)
local ex = redis.call('HGET', KEYS[2], FIELD.execution)
if ex then
  redis.call('ZREM', KEY.wip(origin), ex)
  redis.call('DEL', KEY.execution(ex))
  redis.call('ZREM', KEY.executions(ARGV[1]), string.sub(ex, #ARGV[1] + 2))
  redis.call('HDEL', KEYS[2], FIELD.execution)
end
if ARGV[3] ~= '' then
  local before = redis.call('HGET', KEYS[2], FIELD.died_on)
  redis.call('HSET', KEYS[2], FIELD.died_on, before and (before .. ',' .. ARGV[3]) or ARGV[3])
end
if ARGV[2] == '1' then
  if ARGV[4] == '0' then redis.call('HINCRBY', KEYS[2], FIELD.drains, 1) end
  return redis.call('HINCRBY', KEYS[2], FIELD.attempt, 1)
end
return tonumber(redis.call('HGET', KEYS[2], FIELD.attempt) or '0') or 0
