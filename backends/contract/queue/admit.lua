-- admit: reserve a request's jobs against its tenant's limits, or refuse them all.
-- KEYS: the tenant's open zset, its queued zset, its rate prefix, its usage hash prefix, the zset
-- of tenants with usage
-- ARGV: jobs asking (n), max_concurrent (0: none), max_queued (-1: none), requests_per_minute
-- (0: none), tokens_per_minute (0: none), lifetime of a reservation (ms), the tenant's name, then
-- the n job ids
-- Returns {'ok'} after reserving the n jobs (in both zsets, scored by their expiry, and counted
-- in this minute's requests), or {limit name, seconds to wait, current count} refusing all of
-- them (the refusal is counted in this hour's usage and the total as 'rejected_<limit>').
-- One script, so many gateways on many hosts never admit past a limit together. Entries whose
-- expiry passed are dropped first: a job whose ending never came (its record expired) frees its
-- place within one lifetime.
local n, maxc, maxq = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local rpm, tpm, life = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local minute = math.floor(t[1] / 60)
local rate = KEYS[3] .. ':' .. minute
local wait_minute = 60 - (t[1] % 60)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local function refuse(limit, wait, count)
  local hour = math.floor(t[1] / 3600)
  for _, usage in ipairs({KEYS[4] .. ':' .. hour, KEYS[4] .. ':total'}) do
    redis.call('HINCRBY', usage, 'rejected_' .. limit, 1)
    redis.call('EXPIRE', usage, USAGE_TTL)
  end
  redis.call('ZADD', KEYS[5], hour, ARGV[7])
  redis.call('EXPIRE', KEYS[5], USAGE_TTL)
  return {limit, wait, count}
end
local f = redis.call('HMGET', rate, 'requests', 'tokens')
local requests, tokens = tonumber(f[1] or '0') or 0, tonumber(f[2] or '0') or 0
if rpm > 0 and requests + n > rpm then return refuse('requests_per_minute', wait_minute, requests) end
if tpm > 0 and tokens >= tpm then return refuse('tokens_per_minute', wait_minute, tokens) end
local open, queued = redis.call('ZCARD', KEYS[1]), redis.call('ZCARD', KEYS[2])
if maxc > 0 and open + n > maxc then return refuse('max_concurrent', 1, open) end
if maxq >= 0 and queued + n > maxq then return refuse('max_queued', 1, queued) end
for i = 8, 7 + n do
  redis.call('ZADD', KEYS[1], now + life, ARGV[i])
  redis.call('ZADD', KEYS[2], now + life, ARGV[i])
end
for k = 1, 2 do  -- never shorten: the set holds places confirmed for longer (confirm_places)
  if redis.call('PTTL', KEYS[k]) < life then redis.call('PEXPIRE', KEYS[k], life) end
end
redis.call('HINCRBY', rate, 'requests', n)
redis.call('EXPIRE', rate, 120)
return {'ok'}
