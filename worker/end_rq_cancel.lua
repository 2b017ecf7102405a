-- KEYS: job hash, stream   ARGV: result JSON, ttl, final field, owner field, attempt field
-- Ends a job RQ's own job.cancel() took off a queue: only if it is still canceled, has no final
-- entry and is held by no worker. Returns 1 if ended, else 0.
-- Key literals: 'fleet:inflight:' mirrors keys.inflight_key; string.sub(KEYS[1], 8) strips the
-- 'rq:job:' of keys.job_key to get the job id.
local f = redis.call('HMGET', KEYS[1], 'status', ARGV[3], ARGV[4], ARGV[5])
if f[1] ~= 'canceled' or f[2] then return 0 end
if f[3] and f[3] ~= '' and redis.call('LPOS', 'fleet:inflight:' .. f[3], string.sub(KEYS[1], 8)) then
  return 0
end
local attempt = (tonumber(f[4] or '0') or 0) + 1
redis.call('XADD', KEYS[2], '*', 'a', attempt, 'k', 'd', 'v', ARGV[1])
redis.call('HSET', KEYS[1], ARGV[3], attempt)
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
return 1
