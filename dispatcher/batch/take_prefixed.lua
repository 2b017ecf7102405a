-- KEYS: queues   ARGV: id prefix
-- Takes every id starting with the prefix out of the lists in one pass (LREM per id would be
-- quadratic in a long queue). Returns the ids taken.
local taken = {}
local n = #ARGV[1]
for _, queue in ipairs(KEYS) do
  local items = redis.call('LRANGE', queue, 0, -1)
  local keep = {}
  for _, id in ipairs(items) do
    if string.sub(id, 1, n) == ARGV[1] then taken[#taken + 1] = id else keep[#keep + 1] = id end
  end
  if #keep < #items then
    redis.call('DEL', queue)
    for i = 1, #keep, 4000 do redis.call('RPUSH', queue, unpack(keep, i, math.min(i + 3999, #keep))) end
  end
end
return taken
