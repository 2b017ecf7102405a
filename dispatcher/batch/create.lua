-- KEYS: state, index   ARGV: batch id, fingerprint, expire-at, now, then field, value, ...
-- Creates the batch unless it exists. Returns the existing one's fingerprint and state, or nil.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.call('HMGET', KEYS[1], 'fingerprint', 'state')
end
redis.call('HSET', KEYS[1], 'fingerprint', ARGV[2], unpack(ARGV, 5))
redis.call('EXPIREAT', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
if redis.call('EXPIRETIME', KEYS[2]) < tonumber(ARGV[3]) then redis.call('EXPIREAT', KEYS[2], ARGV[3]) end
return nil
