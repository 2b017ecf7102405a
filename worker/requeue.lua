-- KEYS: inflight, queue, job hash   ARGV: job id, bump attempt (0/1), attempt field, died-on field,
-- name of the dead worker ('' if none)
-- Back to the FRONT of its queue (it already waited its turn). Returns the new attempt count
-- (or -1 if the id was no longer in flight: someone else requeued or finished it).
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return -1 end
redis.call('LPUSH', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[3], 'status', 'queued')
if ARGV[5] ~= '' then
  local before = redis.call('HGET', KEYS[3], ARGV[4])
  redis.call('HSET', KEYS[3], ARGV[4], before and (before .. ',' .. ARGV[5]) or ARGV[5])
end
if ARGV[2] == '1' then return redis.call('HINCRBY', KEYS[3], ARGV[3], 1) end
return tonumber(redis.call('HGET', KEYS[3], ARGV[3]) or '0') or 0
