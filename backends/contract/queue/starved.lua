-- KEYS: the pool's queues (priority order)
-- ARGV: the tenants' share (tenant_share.lua)
-- Returns, for a worker with no free slot, who should give way: a flat list of tenant, count
-- pairs, then '|', then tenant, count pairs: tenants with jobs queued that hold fewer slots than
-- their share here and are not a whole job ahead in tokens, and how many more they may take (at
-- most what they have queued); tenants that hold more than their share, and by how many. Read
-- only.
local weight, holds, cap, _, _, _, ahead = tenant_share(ARGV[1])
local want, over, seen = {}, {}, {}
for _, queue_key in ipairs(KEYS) do
  local fair = KEY.fair(queue_name_of(queue_key))
  if redis.call('TYPE', fair).ok == 'zset' then
    for _, tenant in ipairs(redis.call('ZRANGE', fair, 0, 255)) do
      local key = KEY.queue(tenant_queue(queue_name_of(queue_key), tenant))
      local most = cap(fair, tenant, queue_name_of(queue_key))
      if most and not seen[tenant] and redis.call('TYPE', key).ok == 'list' then
        local waiting = redis.call('LLEN', key)
        if waiting > 0 and holds(tenant) < most and not ahead(fair, tenant, queue_name_of(queue_key)) then
          seen[tenant] = true
          want[#want + 1] = tenant
          want[#want + 1] = math.min(waiting, most - holds(tenant))
        end
      end
    end
    if #want > 0 and #over == 0 then
      for tenant in pairs(cjson.decode(ARGV[1]).held or {}) do
        local most = cap(fair, tenant, queue_name_of(queue_key))
        if most and holds(tenant) > most then
          over[#over + 1] = tenant
          over[#over + 1] = holds(tenant) - most
        end
      end
    end
  end
end
want[#want + 1] = '|'
for _, v in ipairs(over) do want[#want + 1] = v end
return want
