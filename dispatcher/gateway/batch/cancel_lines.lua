-- KEYS: state, lines
-- ARGV: now, cancel flag TTL, job id prefix of the batch ('fbatch-<id>-'), job key prefix,
-- in-flight key prefix, cancel key prefix, owner field, then line keys (one bounded chunk)
-- Cancels the chunk's queued lines. Returns how many were recorded as cancelled here.
-- A line a worker holds (its id in the owner's in-flight list) gets the cancel flag of any fleet
-- job and is recorded when that worker ends it. Any other queued line is waiting in a queue (or
-- its job is gone): its job hash shrinks to a tombstone (status canceled, the batch's TTL) and the
-- line is recorded as cancelled now. The claim script drops a queue entry whose job is canceled,
-- so no queue is ever searched here: the work is bounded by the chunk, not the queue's length.
-- Nothing here may raise (a script that errors keeps its earlier writes): keys a producer could
-- have written are type-checked before use.
local now, cancelled = ARGV[1], 0
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end  -- expired: recreate nothing without TTL
local ttl = redis.call('TTL', KEYS[1])
if ttl < 1 then ttl = 86400 end
for i = 8, #ARGV do
  local key = ARGV[i]
  local v = redis.call('HGET', KEYS[2], key)
  if v and string.sub(v, 1, 1) == 'q' then
    local id = ARGV[3] .. key
    local job = ARGV[4] .. id
    local owner = redis.call('TYPE', job).ok == 'hash' and redis.call('HGET', job, ARGV[7])
    local holder = (owner and owner ~= '') and (ARGV[5] .. owner) or nil
    if holder and redis.call('TYPE', holder).ok == 'list' and redis.call('LPOS', holder, id) then
      redis.call('SET', ARGV[6] .. id, 1, 'EX', ARGV[2])
    else
      if redis.call('EXISTS', job) == 1 then  -- whatever its type: nothing else may run it
        redis.call('DEL', job)
        redis.call('HSET', job, 'status', 'canceled')
        redis.call('EXPIRE', job, ttl)
      end
      redis.call('HSET', KEYS[2], key, 'x' .. string.sub(v, 2) .. '\n{"at":' .. now .. '}')
      redis.call('HINCRBY', KEYS[1], 'cancelled', 1)  -- with its line: an error cannot split them
      cancelled = cancelled + 1
    end
  end
end
return cancelled
