-- end_rq_cancel: ends a job RQ's own job.cancel() took off a queue: only if it is still
-- canceled, has no final entry and is held by no worker; its tenant's admission places are let go.
-- KEYS: job hash, stream   ARGV: job id, result JSON, ttl
-- Returns 1 if ended, else 0.
local f = redis.call('HMGET', KEYS[1], 'status', FIELD.final, FIELD.owner, FIELD.attempt, 'origin')
if f[1] ~= 'canceled' or f[2] then return 0 end
if f[3] and f[3] ~= '' and redis.call('TYPE', KEY.inflight(f[3])).ok == 'list'
    and redis.call('LPOS', KEY.inflight(f[3]), ARGV[1]) then
  return 0
end
local _, tenant = split_queue(f[5] or '')
release_places(tenant, ARGV[1], true)
local attempt = (tonumber(f[4] or '0') or 0) + 1
redis.call('XADD', KEYS[2], '*', 'a', attempt, 'k', 'd', 'v', ARGV[2])
redis.call('HSET', KEYS[1], FIELD.final, attempt)
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return 1
