-- KEYS: job hash   ARGV: hung field, owner field, worker
-- Appends the worker to the job's hung list, only while it owns the job (one the reaper took from
-- it meanwhile is another worker's now). Returns 1 if marked, else 0.
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' or redis.call('HGET', KEYS[1], ARGV[2]) ~= ARGV[3] then
  return 0
end
local before = redis.call('HGET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], before and (before .. ',' .. ARGV[3]) or ARGV[3])
return 1
