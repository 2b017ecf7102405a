-- The batch-settling function shared by record_end.lua here and the producers' settle.lua and
-- start.lua in dispatcher/gateway/batch/ (loaded before each of them; it defines `settle` and returns
-- nothing).
-- settle(state key, lines key, now): ends the batch when every enqueued line has ended (state
-- in_progress -> completed, cancelling -> cancelled) and keeps its record for `retention` more
-- seconds. Returns 2 when the batch ended now, else 1.
local function settle(meta, lines, now)
  local m = redis.call('HMGET', meta, 'state', 'enqueued', 'completed', 'failed', 'cancelled', 'retention')
  local ended = tonumber(m[3] or '0') + tonumber(m[4] or '0') + tonumber(m[5] or '0')
  if ended < tonumber(m[2] or '0') then return 1 end
  local final
  if m[1] == 'in_progress' then final = 'completed' elseif m[1] == 'cancelling' then final = 'cancelled'
  else return 1 end
  redis.call('HSET', meta, 'state', final, final .. '_at', now)
  local ttl = tonumber(m[6] or '86400')
  redis.call('EXPIRE', meta, ttl)
  redis.call('EXPIRE', lines, ttl)
  return 2
end
