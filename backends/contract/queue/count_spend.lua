-- count_spend: add an ended job's tokens to its tenant's spend for today (Redis's clock, so every
-- worker and gateway agree on the day). Queued in the worker's final MULTI: counted exactly once.
-- KEYS: the tenant's spend prefix
-- ARGV: prompt tokens, cached prompt tokens, completion tokens
local day = KEYS[1] .. ':' .. math.floor(tonumber(redis.call('TIME')[1]) / 86400)
redis.call('HINCRBY', day, 'prompt_tokens', ARGV[1])
redis.call('HINCRBY', day, 'cached_tokens', ARGV[2])
redis.call('HINCRBY', day, 'completion_tokens', ARGV[3])
redis.call('EXPIRE', day, SPEND_TTL)
return 1
