-- KEYS: inflight, queue, job hash, wip registry of the queue
-- ARGV: job id, bump attempt (0/1), attempt field, died-on field, name of the dead worker ('' if
-- none), owner field, drains field, counted (0: a drain hand-back, not a failure), execution field,
-- suspect field (cleared: the next worker's start sets its own)
-- Back to the FRONT of its queue (it already waited its turn), owner cleared and the attempt's RQ
-- execution removed in the same step (so a lost reply leaves none). Returns the new attempt count
-- (or -1 if the id was no longer in flight: someone else requeued or finished it).
-- Key literals: 'rq:execution:' mirrors keys.execution_key, 'rq:executions:' keys.executions_key.
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return -1 end
redis.call('LPUSH', KEYS[2], ARGV[1])
if redis.call('TYPE', KEYS[3]).ok ~= 'hash' then return 0 end
redis.call('HSET', KEYS[3], 'status', 'queued')
redis.call('HDEL', KEYS[3], ARGV[6])
if ARGV[10] then redis.call('HDEL', KEYS[3], ARGV[10]) end
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
