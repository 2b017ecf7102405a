-- The tenants' share of a worker's slots (claim.lua and starved.lua load this
-- first). `tenant_share(json)` reads the worker's share argument ({"w": {tenant: weight},
-- "held": {tenant: jobs it runs}, "recent": {tenant: 1}, "slots": n, "reserve": n, "tok": token
-- weights}) and returns weight(t), holds(t), cap(fair zset key, t, pool queue name), the held
-- table (a claim counts its picks into it), the decoded argument (its other fields: slots,
-- placement), estimate(job key), what a job is charged at its claim (queue/fair.py), and ahead.
-- cap: a tenant may hold its weight's share of the slots among the tenants with work (queued in
-- `fair`, running on this worker, or recently: a closed-loop user between two requests); a lone
-- tenant all but `reserve`; nil: no cap (slots 0). A tenant behind in tokens, whose counter would
-- still be the lowest after its next job's charge, may take any free slot: slots shared by weight
-- alone would give a tenant of long prompts the same slots as one of short questions, and so
-- many times the tokens. ahead(fair, t, pool queue): a tenant a whole job ahead in tokens does
-- not make others give way (starved.lua), or what the one behind took would be handed back at
-- once.
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
  local tok = type(share.tok) == 'table' and share.tok or {}
  local function estimate(job)
    if redis.call('TYPE', job).ok ~= 'hash' then return tonumber(tok.u) or 256 end
    local p, g = string.match(tostring(redis.call('HGET', job, FIELD.size) or ''), '^(%d+) (%d+)$')
    if not p then return tonumber(tok.u) or 256 end
    return (tonumber(tok.p) or 1) * tonumber(p) + (tonumber(tok.g) or 2) * tonumber(g)
  end
  -- the charge of the job at the head of `tenant`'s queue (0: none waits), over its weight
  local function next_charge(base, tenant)
    local queue = KEY.queue(tenant_queue(base, tenant))
    if redis.call('TYPE', queue).ok ~= 'list' then return 0 end
    local head = redis.call('LINDEX', queue, 0)
    if not head then return 0 end
    return estimate(KEY.job(head)) / weight(tenant)
  end
  -- `tenant`'s counter and the lowest other tenant with work (nil: not listed, not lifted yet)
  local function standing(fair, tenant)
    local ranked = redis.call('ZRANGE', fair, 0, 255, 'WITHSCORES')
    local mine, low, lowest = nil, nil, nil
    for i = 1, #ranked, 2 do
      local score = tonumber(ranked[i + 1]) or 0
      if ranked[i] == tenant then mine = score
      elseif low == nil or score < low then low, lowest = score, ranked[i] end
    end
    if mine == nil or mine < 0 or low == nil or low < 0 then return nil end
    return mine, low, lowest
  end
  -- behind: still the lowest after its next job's charge; ahead: a whole job (the next of the
  -- tenant it is ahead of) past the lowest other
  local function behind(fair, tenant, base)
    local mine, low = standing(fair, tenant)
    local next = mine and next_charge(base, tenant) or 0
    return mine ~= nil and next > 0 and mine + next < low
  end
  local function ahead(fair, tenant, base)
    local mine, low, lowest = standing(fair, tenant)
    return mine ~= nil and mine >= low + next_charge(base, lowest)
  end
  local function cap(fair, tenant, base)
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
    if base and behind(fair, tenant, base) then return slots end
    return math.max(1, math.floor(slots * weight(tenant) / total))
  end
  return weight, holds, cap, held, share, estimate, ahead
end
