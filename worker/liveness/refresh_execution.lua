-- KEYS: execution hash, wip registry, the job's executions
-- ARGV: now, ttl, wip member, execution id
-- RQ's Execution.heartbeat() writes unconditionally: a beat racing a job's final write (which
-- deletes the execution) would re-create the execution with a 10-minute TTL. This refreshes it
-- only while it exists (every key ends with a TTL or is removed, promptly).
-- Returns 1 if refreshed, 0 if the execution is gone.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local now, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'last_heartbeat', ARGV[1])
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('ZADD', KEYS[2], 'XX', now + ttl, ARGV[3])
redis.call('ZADD', KEYS[3], 'XX', now + ttl + 60, ARGV[4])
redis.call('EXPIRE', KEYS[3], ttl + 60)
return 1
