-- KEYS: queue, job hash, stream, canceled registry   ARGV: job id, result JSON, ttl, now, attempt
-- field, final field
-- Cancels a job that is still queued, in one step: taken off the queue, marked canceled, final
-- stream entry written, the hash and the stream set to expire with the result. Returns 0 when the
-- job was not in the queue (a worker holds it, or it ended), so a retried call after a lost reply
-- cannot cancel twice.
if redis.call('LREM', KEYS[1], 0, ARGV[1]) == 0 then return 0 end
local attempt = tonumber(redis.call('HGET', KEYS[2], ARGV[5]) or '0') or 0
redis.call('HSET', KEYS[2], 'status', 'canceled', ARGV[6], attempt + 1)
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('ZADD', KEYS[4], tonumber(ARGV[4]) + tonumber(ARGV[3]), ARGV[1])
redis.call('XADD', KEYS[3], '*', 'a', attempt + 1, 'k', 'd', 'v', ARGV[2])
redis.call('EXPIRE', KEYS[3], ARGV[3])
return 1
