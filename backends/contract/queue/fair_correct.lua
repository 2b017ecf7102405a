-- A job's ending corrects its tenant's fair-share counter from the claim's estimate to what the
-- job was served (backends/contract/queue/fair.py). Runs inside the ending's MULTI, so once per
-- ending; and it sets the job's charge to the real amount, so running it again changes nothing.
-- KEYS: the job hash, the fair zset of its pool queue, that queue's spent hash
-- ARGV: tenant, the job's real service in weighted tokens
-- Returns the counter's change.
local job, fair, spent = KEYS[1], KEYS[2], KEYS[3]
local tenant, real = ARGV[1], tonumber(ARGV[2])
if not real or redis.call('TYPE', job).ok ~= 'hash' then return '0' end
local was, w = string.match(tostring(redis.call('HGET', job, FIELD.charged) or ''), '^(%S+) (%S+)$')
was, w = tonumber(was), tonumber(w)
if not was or not w or w <= 0 then return '0' end  -- never charged: its queue had no fair share
redis.call('HSET', job, FIELD.charged, tostring(real) .. ' ' .. tostring(w))
local delta = (real - was) / w
if delta == 0 then return '0' end
local now = redis.call('TYPE', fair).ok == 'zset' and tonumber(redis.call('ZSCORE', fair, tenant) or '')
if now and now >= 0 then
  redis.call('ZINCRBY', fair, delta, tenant)
elseif redis.call('TYPE', spent).ok == 'hash' and redis.call('HEXISTS', spent, tenant) == 1 then
  redis.call('HINCRBYFLOAT', spent, tenant, delta)  -- away, or back and not yet lifted: its kept counter
end
return tostring(delta)
