-- KEYS: lock   ARGV: owner token, milliseconds
-- Extends a lock's life only if we still own it. Returns 1 if extended, else 0.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
