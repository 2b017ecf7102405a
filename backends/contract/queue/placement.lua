-- Placement by held prefixes (claim.lua loads this first; backends/contract/affinity.py
-- says what the keys are). A job hash's 'fleet_affinity' field lists its prefixes' keys, longest
-- first; 'fleet:held:<pool>:<key>' names the worker that last ran that prefix and holds its KV.
-- A claim leaves to its holder a job that another live worker with a free slot holds, and wakes
-- it (its own wake list): that worker claims it at once when idle, between steps when busy, and
-- prefills only what is new. A holder that is full, busy in a long step or gone (its capacity
-- entry, balance.lua) is not waited for. But a holder with a KV store (its capacity entry ends
-- in the store's id) left the prefix there too: the job then goes to a live worker with room
-- that opens the same store (on the holder's host, or one mounting its directory), which
-- restores it rather than prefilling it; only when none has room does balance win over the
-- cache, as it should. Only the first LOOK_AHEAD jobs of a queue are looked at, and only when
-- its head is left to another worker, so a claim costs O(1) when nothing is held and
-- O(LOOK_AHEAD x workers) at worst, however long the queue.
-- A worker that balance keeps from taking more (balance.lua) still takes the jobs left to it,
-- or nobody would: the others leave them to it.
-- placement(me, pool, capacity, now, live_ms, on, store) -> pop(list key, mine_only): an id
-- (nil: none for this worker) and whether the queue kept jobs back (left to others, or not this
-- worker's).
local function placement(me, pool, capacity, now, live_ms, on, store)
  local look_ahead = 8
  local function room_in(entry)
    if type(entry) ~= 'string' then return false end
    local free, _, at = string.match(entry, '^(%d+)|(%d+)|(%d+)')
    return free ~= nil and tonumber(free) > 0 and now - tonumber(at) <= live_ms
  end
  local function store_of(entry)
    if type(entry) ~= 'string' then return nil end
    return string.match(entry, '^%d+|%d+|%d+|(%x+)$')
  end
  local stores = nil  -- store id -> the first live worker with room that opens it (this claim's view)
  local function taker_in(holder_store)
    if stores == nil then
      stores = {}
      local entries = redis.call('HGETALL', capacity)
      for i = 1, #entries, 2 do
        local s = store_of(entries[i + 1])
        if s ~= nil and stores[s] == nil and room_in(entries[i + 1]) then stores[s] = entries[i] end
      end
      if type(store) == 'string' and store ~= '' then stores[store] = me end  -- claiming: room
    end
    return stores[holder_store]
  end
  local function holder_of(id)  -- the worker holding the job's longest held prefix
    local key = KEY.job(id)
    if redis.call('TYPE', key).ok ~= 'hash' then return nil end
    local keys = redis.call('HGET', key, 'fleet_affinity')
    if type(keys) ~= 'string' then return nil end
    local n = 0
    for k in string.gmatch(keys, '%x+') do  -- a producer wrote it: hex words only, a few
      n = n + 1
      if n > 9 then return nil end
      local held = KEY.held(pool, k)
      if redis.call('TYPE', held).ok == 'string' then return redis.call('GET', held) end
    end
    return nil
  end
  local woken = {}
  local function wake(worker)  -- an idle holder blocks on its own wake list: it claims at once
    if woken[worker] then return end
    woken[worker] = true
    local key = KEY.worker_wake(pool, worker)
    redis.call('LPUSH', key, '1')
    redis.call('LTRIM', key, 0, 0)
    redis.call('EXPIRE', key, WORKER_WAKE_TTL)
  end
  local function left_to(id)  -- the worker this job waits for (nil: anyone's)
    local holder = holder_of(id)
    if holder == nil or holder == me then return holder end
    local entry = redis.call('HGET', capacity, holder)
    if room_in(entry) then return holder end
    local holder_store = store_of(entry)
    if holder_store == nil then return nil end
    return taker_in(holder_store)
  end
  local function left_to_another(id)
    local worker = left_to(id)
    if worker ~= nil and worker ~= me then
      wake(worker)
      return true
    end
    return false
  end
  local function take_first(list, start, wanted)  -- the first of the look-ahead `wanted` takes
    for _, id in ipairs(redis.call('LRANGE', list, start, look_ahead - 1)) do
      if wanted(id) then
        redis.call('LREM', list, 1, id)
        return id
      end
    end
    return nil
  end
  return function(list, mine_only)
    if redis.call('TYPE', list).ok ~= 'list' then return nil, false end
    local head = redis.call('LINDEX', list, 0)
    if not head then return nil, false end
    if mine_only then
      if not on then return nil, true end
      return take_first(list, 0, function(id) return left_to(id) == me end), true
    end
    if not on or not left_to_another(head) then return redis.call('LPOP', list), false end
    return take_first(list, 1, function(id) return not left_to_another(id) end), true
  end
end
