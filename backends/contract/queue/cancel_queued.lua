-- cancel_queued: a job still waiting in its queue is cancelled in one step: taken off the queue,
-- its tenant's admission places let go (admit.lua), marked canceled, the final stream entry
-- written, the hash and the stream set to expire with the result.
-- KEYS: job hash, stream   ARGV: job id, result JSON, ttl, now (s)
-- Returns 0 when the job was not in its queue (a worker holds it, or it ended), so a retried
-- call after a lost reply cannot cancel twice.
local origin = origin_of(KEYS[1])
if origin == nil then return 0 end
local queue = KEY.queue(origin)
if redis.call('TYPE', queue).ok ~= 'list' or redis.call('LREM', queue, 0, ARGV[1]) == 0 then return 0 end
local _, tenant = split_queue(origin)
release_places(tenant, ARGV[1], true)
local attempt = tonumber(redis.call('HGET', KEYS[1], FIELD.attempt) or '0') or 0
local ttl = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'status', 'canceled', FIELD.final, attempt + 1)
redis.call('EXPIRE', KEYS[1], ttl)
local registry = KEY.canceled(origin)
if redis.call('TYPE', registry).ok ~= 'zset' and redis.call('EXISTS', registry) == 1 then registry = nil end
if registry then
  redis.call('ZADD', registry, tonumber(ARGV[4]) + ttl, ARGV[1])
  if redis.call('TTL', registry) < ttl then redis.call('EXPIRE', registry, ttl) end
end
redis.call('XADD', KEYS[2], '*', 'a', attempt + 1, 'k', 'd', 'v', ARGV[2])
redis.call('EXPIRE', KEYS[2], ttl)
return 1
