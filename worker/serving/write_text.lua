-- KEYS: job hash, stream
-- ARGV: worker name, owner field, attempt field, attempt, first index, maxlen, text1, text2, ...
-- Text deltas (and a restart's new attempt number) are written only while this worker owns the
-- job (a worker the reaper took it from writes nothing); the attempt number only ever goes up.
-- Returns how many deltas were written, or -1 (not the owner).
if redis.call('HGET', KEYS[1], ARGV[2]) ~= ARGV[1] then return -1 end
local attempt = tonumber(ARGV[4])
local stored = tonumber(redis.call('HGET', KEYS[1], ARGV[3]) or '0') or 0
if stored < attempt - 1 then redis.call('HSET', KEYS[1], ARGV[3], attempt - 1) end
local seq = tonumber(ARGV[5])
for i = 7, #ARGV do
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'a', attempt, 'k', 't', 'n', seq, 'v', ARGV[i])
  seq = seq + 1
end
return #ARGV - 6
