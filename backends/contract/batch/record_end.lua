-- KEYS: state, lines   (loaded after settle_function.lua)
-- ARGV: line key, d/f/x, result JSON, prompt tokens, completion tokens, now
-- One line ended. Returns 0 if the line was not queued (unknown, already ended, or the batch
-- expired: nothing is recreated without a TTL), else 1, or 2 when the batch ended with it.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local v = redis.call('HGET', KEYS[2], ARGV[1])
if not v or string.sub(v, 1, 1) ~= 'q' then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2] .. string.sub(v, 2) .. '\n' .. ARGV[3])
local counter = 'cancelled'
if ARGV[2] == 'd' then counter = 'completed' elseif ARGV[2] == 'f' then counter = 'failed' end
redis.call('HINCRBY', KEYS[1], counter, 1)
redis.call('HINCRBY', KEYS[1], 'prompt_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'completion_tokens', ARGV[5])
return settle(KEYS[1], KEYS[2], ARGV[6])
