-- KEYS: inflight, queue1..queueN (priority order)   ARGV: max jobs
-- returns a flat list: id1, queue1, id2, queue2, ...
local out = {}
local n = tonumber(ARGV[1])
for i = 2, #KEYS do
  while #out < 2 * n do
    local id = redis.call('LMOVE', KEYS[i], KEYS[1], 'LEFT', 'RIGHT')
    if not id then break end
    out[#out + 1] = id
    out[#out + 1] = string.sub(KEYS[i], 10)  -- strip 'rq:queue:'
  end
  if #out >= 2 * n then break end
end
return out
