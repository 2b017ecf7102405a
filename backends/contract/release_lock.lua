-- KEYS: lock   ARGV: owner token
-- Releases a lock only if we still own it. Returns 1 if deleted, else 0.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
