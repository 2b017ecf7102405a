-- A worker's share of a burst (claim.lua loads this first). Without it, the first worker
-- to wake takes every queued job it has slots for while the others idle: a burst of 8 onto two
-- idle 1-core workers split 7/1. `capacity` (fleet:capacity:<pool>) holds, per worker, its free
-- slots after its last claim, its slots and when ("free|slots|ms", then "|store" for a worker
-- with a KV store: placement.lua); an entry older than
-- `live_ms` is a worker that is full (it stops claiming), busy in a long step, or gone, and
-- counts for nothing. A claim may take enough to bring this worker to its slots' share of the
-- work (what is queued plus what the live workers run); when that is nothing and another live
-- worker has a free slot, it takes nothing: that worker claims within its next poll. Alone, or
-- when nobody else has room, it takes what it asked for.
-- balance(capacity, me, now_ms, live_ms, n, slots, queued) -> the most this claim may take;
-- queued(): jobs waiting in this worker's queues. record(capacity, me, now_ms, free, slots, ttl,
-- store).
local function balance(capacity, me, now, live_ms, n, slots, queued)
  if n <= 0 or slots <= 0 or redis.call('TYPE', capacity).ok ~= 'hash' then return n end
  local entries = redis.call('HGETALL', capacity)
  local all_slots, load, others_free = slots, slots - n, 0
  for i = 1, #entries, 2 do
    if entries[i] ~= me then
      local free, their, at = string.match(entries[i + 1], '^(%d+)|(%d+)|(%d+)')
      if free and now - tonumber(at) <= live_ms then
        all_slots = all_slots + tonumber(their)
        load = load + tonumber(their) - tonumber(free)
        others_free = others_free + tonumber(free)
      end
    end
  end
  if others_free == 0 then return n end
  local mine = slots - n
  local target = math.ceil((queued() + load) * slots / all_slots) - mine
  if target < 0 then target = 0 end
  if target < n then return target end
  return n
end
local function record(capacity, me, now, free, slots, ttl, store)
  local entry = free .. '|' .. slots .. '|' .. now
  if type(store) == 'string' and string.match(store, '^%x+$') then entry = entry .. '|' .. store end
  redis.call('HSET', capacity, me, entry)
  redis.call('EXPIRE', capacity, ttl)
end
