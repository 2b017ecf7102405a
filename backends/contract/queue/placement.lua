-- Placement by held prefixes (claim.lua loads this first; backends/contract/affinity.py
-- says what the keys are). A job hash's 'fleet_affinity' field lists its prefixes' keys, longest
-- first; 'fleet:held:<pool>:<key>' names the worker that last ran that prefix and holds its KV.
-- A claim leaves to its holder a job that another live worker with a free slot holds, and wakes
-- it (its own wake list): that worker claims it at once when idle, between steps when busy, and
-- prefills only what is new. A holder that is full,
-- busy in a long step or gone (its capacity entry, balance.lua) is not waited for: then
-- balance wins over the cache, as it should. Only the first LOOK_AHEAD jobs of a queue are
-- looked at, and only when its head is left to another worker, so a claim costs O(1) when
-- nothing is held and O(LOOK_AHEAD) at worst, however long the queue.
-- A worker that balance keeps from taking more (balance.lua) still takes the jobs it
-- holds, or nobody would: the others leave them to it.
-- placement(me, pool, capacity, now, live_ms, on) -> pop(list key, mine_only): an id (nil: none
-- for this worker) and whether the queue kept jobs back (left to others, or not this worker's).
local function placement(me, pool, capacity, now, live_ms, on)
  local look_ahead = 8
  local function has_room(worker)
    local entry = redis.call('HGET', capacity, worker)
    if type(entry) ~= 'string' then return false end
    local free, _, at = string.match(entry, '^(%d+)|(%d+)|(%d+)$')
    return free ~= nil and tonumber(free) > 0 and now - tonumber(at) <= live_ms
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
  local function left_to_another(id)
    local holder = holder_of(id)
    if holder ~= nil and holder ~= me and has_room(holder) then
      wake(holder)
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
      return take_first(list, 0, function(id) return holder_of(id) == me end), true
    end
    if not on or not left_to_another(head) then return redis.call('LPOP', list), false end
    return take_first(list, 1, function(id) return not left_to_another(id) end), true
  end
end
