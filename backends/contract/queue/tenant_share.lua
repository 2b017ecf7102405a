-- The tenants' share of a worker's slots (claim.lua and starved.lua load this
-- first). `tenant_share(json)` reads the worker's share argument ({"w": {tenant: weight},
-- "held": {tenant: jobs it runs}, "recent": {tenant: 1}, "slots": n, "reserve": n}) and returns
-- weight(t), holds(t),
-- cap(fair zset key, t), the held table (a claim counts its picks into it) and the decoded
-- argument (its other fields: slots, placement).
-- cap: a tenant may hold its weight's share of the slots among the tenants with work (queued in
-- `fair`, running on this worker, or recently: a closed-loop user between two requests); a lone
-- tenant all but `reserve`; nil: no cap (slots 0).
local function tenant_share(json)
  local ok, share = pcall(cjson.decode, json or '{}')
  if not ok or type(share) ~= 'table' then share = {} end
  local weights = type(share.w) == 'table' and share.w or {}
  local held = type(share.held) == 'table' and share.held or {}
  local recent = type(share.recent) == 'table' and share.recent or {}
  local slots, reserve = tonumber(share.slots) or 0, tonumber(share.reserve) or 0
  local function weight(tenant)
    local w = tonumber(weights[tenant])
    if w and w > 0 then return w end
    return 1
  end
  local function holds(tenant) return tonumber(held[tenant]) or 0 end
  local function cap(fair, tenant)
    if slots <= 0 then return nil end
    local active, total = {}, 0
    for t, n in pairs(held) do
      if (tonumber(n) or 0) > 0 and not active[t] then active[t] = true; total = total + weight(t) end
    end
    for t in pairs(recent) do
      if not active[t] then active[t] = true; total = total + weight(t) end
    end
    for _, t in ipairs(redis.call('ZRANGE', fair, 0, 255)) do
      if not active[t] then active[t] = true; total = total + weight(t) end
    end
    local others = false
    for t in pairs(active) do if t ~= tenant then others = true end end
    if not others then return slots - reserve end
    return math.max(1, math.floor(slots * weight(tenant) / total))
  end
  return weight, holds, cap, held, share
end
