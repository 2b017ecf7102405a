-- KEYS: inflight, owners set, the worker's status key, queue1..queueN (priority order), the
-- pool's capacity hash (balance.lua)
-- ARGV: max jobs, worker name, pick counter, owner field, final field, attempt field, '1' if the
-- status key must exist, the tenants' share (JSON: {"w": {tenant: weight > 0, 1 when absent},
-- "held": {tenant: jobs this worker runs}, "slots": its slots, "reserve": slots kept from a lone
-- tenant, "store": the id of its KV store, if any, "tok": the token weights, fair.claim_args}),
-- then optionally per queue the most jobs the claim may hold once it took from that queue
-- (worker/claiming/priority.py)
-- Returns: server time (ms), ids dropped (-1: refused, the status key is missing), then id1,
-- queue1, id2, queue2, ...
-- A worker whose status key expired is dead to the fleet: the reaper hands back whatever it holds.
-- One that comes back from a Redis outage before its heartbeat re-registered it must not claim,
-- or every job it claims is reaped again and loses an attempt (three in a row fail the job).
-- Ownership is taken here, in the same script that moves the id, so two workers can never both
-- start one id: an id whose job hash names a live holder (its owner's
-- in-flight list has it) is a second copy and is dropped; so is a leftover copy of a job that
-- already ended. A job re-run by RQ's own tools (`rq requeue`: status queued, but its attempt
-- already got a final entry) gets a new attempt number, so readers void the old ending.
-- Fairness: of every 8 picks, the 4th starts at the second queue (default) and the
-- 8th at the last one (low), so lower priorities move under sustained high-priority load
-- (FAIR_EVERY in worker/claiming/claim.py).
-- Tenants: within one priority, the tenants with work share the service in tokens in proportion
-- to their weights (the Virtual Token Counter: backends/contract/queue/fair.py). A tenant's jobs
-- wait in '<queue>:<tenant>' (the default tenant's in the queue itself); 'fleet:fair:<queue>'
-- holds each tenant with work and its counter, which grows by a job's charge (its size, in
-- weighted tokens, over the tenant's weight) as the job is taken; the lowest counter goes next.
-- Producers add a tenant at FAIR_NEWCOMER when they enqueue; its first visit here lifts it to the
-- lowest counter of the tenants with work (the last pick's, '<fair>:clock', when none has one) or
-- its own from before it ran out of work ('<fair>:spent'), whichever is higher, so idle time
-- earns no credit. An empty tenant queue leaves the set here, its counter kept in '<fair>:spent'.
-- Without the set (nobody named a tenant) a queue is plain FIFO. The claimed job's queue is reported as the priority's
-- own queue: its registries and its priority go by it (a hand-back finds the tenant's queue from
-- the job's origin: requeue.lua).
-- Slots are shared too, or a tenant that filled them all would make a newcomer wait for its jobs
-- to end: a tenant may hold at most its weight's share of this worker's slots among the tenants
-- with work (queued here or running on this worker), and a lone tenant all but `reserve` of them,
-- so another tenant's first job starts at once.
-- Key names, fields and TTLs: the prelude (rendered from backends/contract/keys.py).
-- Nothing after an LPOP may raise: a script that errors keeps its earlier writes, so the popped
-- id would be in no list at all. Fields a producer can write are therefore read defensively: an
-- owner whose in-flight key is not a list holds nothing, and the attempt is set, not HINCRBY'd.
local n, me, pick = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local t = redis.call('TIME')
local out = {t[1] * 1000 + math.floor(t[2] / 1000), 0}
if ARGV[7] == '1' and redis.call('EXISTS', KEYS[3]) == 0 then
  out[2] = -1
  return out
end
local nq = #KEYS - 4
local capacity = KEYS[#KEYS]
local ended = {finished = true, failed = true, stopped = true, canceled = true}
local function order(p)
  local first = 1
  if nq >= 2 and p % 8 == 3 then first = 2 elseif nq >= 3 and p % 8 == 7 then first = nq end
  local o = {}
  for i = 0, nq - 1 do o[#o + 1] = 3 + ((first - 1 + i) % nq) + 1 end
  return o
end
local weight, holds, cap, held, share, estimate = tenant_share(ARGV[8])
local live_ms = CAPACITY_LIVE_MS  -- a capacity entry older than this is a worker full, busy or gone
-- pops only a list (an error after an earlier LPOP would lose its id), leaving to other workers
-- the jobs whose prefixes they hold (placement.lua)
local pool = string.match(queue_name_of(KEYS[4] or ''), '^(.*):[^:]+$') or ''
local list_pop = placement(me, pool, capacity, out[1], live_ms, share.placement ~= false, share.store)
-- the job's charge to its tenant (weighted tokens over `w`), written to the job hash once: a job
-- handed back and claimed again is not charged again (nil: nothing to charge)
local function charge(key, w)
  if redis.call('TYPE', key).ok ~= 'hash' or redis.call('HEXISTS', key, FIELD.charged) == 1 then return nil end
  local raw = estimate(key)
  redis.call('HSET', key, FIELD.charged, tostring(raw) .. ' ' .. tostring(w))
  return raw / w
end
-- a tenant's counter from before it ran out of work (nil: none kept)
local function spent_of(spent_key, tenant)
  if redis.call('TYPE', spent_key).ok ~= 'hash' then return nil end
  return tonumber(redis.call('HGET', spent_key, tenant) or '')
end
local function fair_pop(queue_key, mine_only)
  local fair = KEY.fair(queue_name_of(queue_key))
  if redis.call('TYPE', fair).ok ~= 'zset' then return (list_pop(queue_key, mine_only)), nil end
  local clock_key, spent_key = fair .. ':clock', KEY.fair_spent(queue_name_of(queue_key))
  local clock = tonumber(redis.call('GET', clock_key) or '0') or 0
  if redis.call('TYPE', queue_key).ok == 'list' and redis.call('LLEN', queue_key) > 0 then
    redis.call('ZADD', fair, 'NX', FAIR_NEWCOMER, DEFAULT_TENANT)
  end
  local full = {}  -- tenants at their cap, passed over in this pop
  for _ = 1, 256 do
    local ranked = redis.call('ZRANGE', fair, 0, 255, 'WITHSCORES')
    local tenant, pass = nil, nil
    for i = 1, #ranked, 2 do
      if not full[ranked[i]] then tenant, pass = ranked[i], tonumber(ranked[i + 1]) or 0; break end
    end
    if tenant == nil then return nil end
    if pass < 0 then
      -- a newcomer: it joins at the lowest counter among the tenants with work, never below its own
      local low = redis.call('ZRANGEBYSCORE', fair, 0, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
      local start = tonumber(low[2] or '') or clock
      local own = spent_of(spent_key, tenant)
      if own and own > start then start = own end
      redis.call('ZADD', fair, start, tenant)
      if own then redis.call('HDEL', spent_key, tenant) end
    elseif holds(tenant) >= (cap(fair, tenant, queue_name_of(queue_key)) or math.huge) then
      full[tenant] = true
    else
      local id, others = list_pop(KEY.queue(tenant_queue(queue_name_of(queue_key), tenant)),
                                  mine_only)
      if others and not id then
        full[tenant] = true  -- its jobs wait for the workers that hold their prefixes
      elseif id then
        redis.call('SET', clock_key, tostring(pass), 'EX', FAIR_TTL)
        redis.call('EXPIRE', fair, FAIR_TTL)
        held[tenant] = holds(tenant) + 1
        return id, {fair, tenant}
      else
        redis.call('ZREM', fair, tenant)
        if redis.call('TYPE', spent_key).ok ~= 'hash' then redis.call('DEL', spent_key) end
        redis.call('HSET', spent_key, tenant, tostring(pass))
        redis.call('EXPIRE', spent_key, FAIR_TTL)
      end
    end
  end
  return nil
end
local function pop(p, claimed, mine_only)
  for _, k in ipairs(order(p)) do
    if claimed < tonumber(ARGV[5 + k] or ARGV[1]) then
      local id, fair = fair_pop(KEYS[k], mine_only)
      if id then return id, queue_name_of(KEYS[k]), fair end
    end
  end
  return nil, nil, nil
end
local function queued()
  local total = 0
  for k = 4, 3 + nq do
    if redis.call('TYPE', KEYS[k]).ok == 'list' then total = total + redis.call('LLEN', KEYS[k]) end
    local fair = KEY.fair(queue_name_of(KEYS[k]))
    if redis.call('TYPE', fair).ok == 'zset' then
      for _, tenant in ipairs(redis.call('ZRANGE', fair, 0, 255)) do
        local q = KEY.queue(tenant_queue(queue_name_of(KEYS[k]), tenant))
        if tenant ~= DEFAULT_TENANT and redis.call('TYPE', q).ok == 'list' then
          total = total + redis.call('LLEN', q)
        end
      end
    end
  end
  return total
end
local slots = tonumber(share.slots) or 0
local share_n = balance(capacity, me, out[1], live_ms, n, slots, queued)
local claimed, looked = 0, 0
while claimed < n and looked < n + 256 do
  -- past its share of the work, a worker takes only the jobs whose prefixes it holds
  local id, queue, fair = pop(pick, claimed, claimed >= share_n)
  if not id then break end
  looked = looked + 1
  local key = KEY.job(id)
  local keep = true
  if redis.call('TYPE', key).ok == 'hash' then
    local f = redis.call('HMGET', key, 'status', ARGV[4], ARGV[5], ARGV[6])
    local status, owner, final = f[1], f[2], f[3]
    local holder = (owner and owner ~= '') and KEY.inflight(owner) or nil
    if holder and redis.call('TYPE', holder).ok == 'list' and redis.call('LPOS', holder, id) then
      keep = false  -- held by a worker (maybe this one): a second copy
    elseif status and ended[status] then
      keep = false  -- a leftover copy of a job that ended
    else
      local before = tonumber(f[4] or '0')
      if final and before and tonumber(final) and tonumber(final) >= before + 1 then
        redis.call('HSET', key, ARGV[6], before + 1)  -- re-run of an ended attempt: a new number
        redis.call('HDEL', key, FIELD.charged)  -- new work: charged again
        redis.call('PERSIST', key)
        redis.call('PERSIST', KEY.stream(id))
      end
      redis.call('HSET', key, ARGV[4], me)
    end
  end
  if keep then
    local c = fair and charge(key, weight(fair[2]))
    if c then redis.call('ZINCRBY', fair[1], c, fair[2]) end
    redis.call('RPUSH', KEYS[1], id)
    out[#out + 1] = id
    out[#out + 1] = queue
    claimed = claimed + 1
    pick = pick + 1
  else
    out[2] = out[2] + 1
  end
end
if claimed > 0 then redis.call('SADD', KEYS[2], me) end
if slots > 0 then record(capacity, me, out[1], n - claimed, slots, CAPACITY_TTL, share.store) end
return out
