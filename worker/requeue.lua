-- KEYS: inflight, queue, job hash, wip registry of the queue
-- ARGV: job id, bump attempt (0/1), attempt field, died-on field, name of the dead worker ('' if
-- none), owner field, drains field, counted (0: a drain hand-back, not a failure), execution field,
-- suspect field (cleared: the next worker's start sets its own)
-- Back to the FRONT of its queue (it already waited its turn), owner cleared and the attempt's RQ
-- execution removed in the same step (so a lost reply leaves none). Returns the new attempt count
-- (or -1 if the id was no longer in flight: someone else requeued or finished it).
-- Key literals: 'rq:execution:' mirrors keys.execution_key, 'rq:executions:' keys.executions_key,
-- 'rq:queue:' QUEUE_PREFIX, 'fleet:fair:' fair_key, 86400 FAIR_TTL.
-- A tenant's job (its RQ origin '<queue>:<tenant>') goes back to its tenant's queue, and the
-- tenant back into the queue's fair share (worker/claim.lua), so it is claimed on its tenant's
-- turns; a crafted origin, or one whose key is no list, sends it to the queue itself.
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return -1 end
local target = KEYS[2]
local is_hash = redis.call('TYPE', KEYS[3]).ok == 'hash'
if is_hash then
  local origin = redis.call('HGET', KEYS[3], 'origin')
  local base = string.sub(KEYS[2], 10)
  if origin and string.sub(origin, 1, #base + 1) == base .. ':' then
    local tenant = string.sub(origin, #base + 2)
    local kind = redis.call('TYPE', 'rq:queue:' .. origin).ok
    if #tenant <= 64 and string.match(tenant, '^[%w_%.%-]+$') and tenant ~= 'default'
        and (kind == 'list' or kind == 'none') then
      target = 'rq:queue:' .. origin
      redis.call('ZADD', 'fleet:fair:' .. base, 'NX', 0, tenant)
      redis.call('EXPIRE', 'fleet:fair:' .. base, 86400)
    end
  end
end
redis.call('LPUSH', target, ARGV[1])
if not is_hash then return 0 end
redis.call('HSET', KEYS[3], 'status', 'queued')
redis.call('HDEL', KEYS[3], ARGV[6])
if ARGV[10] then redis.call('HDEL', KEYS[3], ARGV[10]) end
local ex = redis.call('HGET', KEYS[3], ARGV[9])
if ex then
  redis.call('ZREM', KEYS[4], ex)
  redis.call('DEL', 'rq:execution:' .. ex)
  redis.call('ZREM', 'rq:executions:' .. ARGV[1], string.sub(ex, #ARGV[1] + 2))
  redis.call('HDEL', KEYS[3], ARGV[9])
end
if ARGV[5] ~= '' then
  local before = redis.call('HGET', KEYS[3], ARGV[4])
  redis.call('HSET', KEYS[3], ARGV[4], before and (before .. ',' .. ARGV[5]) or ARGV[5])
end
if ARGV[2] == '1' then
  if ARGV[8] == '0' then redis.call('HINCRBY', KEYS[3], ARGV[7], 1) end
  return redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
end
return tonumber(redis.call('HGET', KEYS[3], ARGV[3]) or '0') or 0
