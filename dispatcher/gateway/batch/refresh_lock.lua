-- KEYS: lock   ARGV: token, ms
-- Refreshes the lock only while we own it. Returns 1 if refreshed, else 0.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
