-- spent: a tenant's spend over each of its budgets' periods, read on Redis's clock.
-- KEYS: the tenant's spend prefix
-- ARGV: pairs of period ('day', 'week' or 'month') and rolling (1) or calendar (0)
-- Returns {now (unix seconds), {tokens, prompt, cached, completion, resets at (unix seconds)} per
-- pair}; tokens are prompt + completion.
local t = redis.call('TIME')
local now = tonumber(t[1])
local today = math.floor(now / 86400)
local out = {}
for i = 1, #ARGV, 2 do
  local first, resets = period_window(today, ARGV[i], ARGV[i + 1] == '1')
  local sums = {0, 0, 0}
  for day = first, today do
    local f = redis.call('HMGET', KEYS[1] .. ':' .. day, 'prompt_tokens', 'cached_tokens', 'completion_tokens')
    for k = 1, 3 do sums[k] = sums[k] + (tonumber(f[k] or '0') or 0) end
  end
  out[#out + 1] = {sums[1] + sums[3], sums[1], sums[2], sums[3], resets}
end
return {now, out}
