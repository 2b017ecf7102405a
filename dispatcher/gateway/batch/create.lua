-- KEYS: state, index, open batches of the pool, open batches of the tenant (or '' for none)
-- ARGV: batch id, fingerprint, expire-at, now, most open lines in the pool (-1: no cap), this
-- batch's lines, state key prefix, most open lines of the tenant (-1: no cap), then field,
-- value, ...
-- Creates the batch unless it exists. Returns {'exists', fingerprint, state}, {'full', open lines
-- of the pool's other batches} or {'tenant_full', open lines of the tenant's} (nothing written),
-- or {'created'}.
-- The expire-at is checked before any write, so no error can leave the record without a TTL.
-- A cap counts the lines not ended yet of every open batch it covers (validating, in_progress,
-- cancelling); ended or expired batches leave the open hash here.
if redis.call('EXISTS', KEYS[1]) == 1 then
  local m = redis.call('HMGET', KEYS[1], 'fingerprint', 'state')
  return {'exists', m[1] or '', m[2] or ''}
end
local at, now = tonumber(ARGV[3]), tonumber(ARGV[4])
if not at or not now or at ~= math.floor(at) or at <= now or at > now + 400 * 86400 then
  return redis.error_reply('ERR batch expire-at out of range: ' .. ARGV[3])
end
local function open_lines(hash)
  local open = 0
  for _, id in ipairs(redis.call('HKEYS', hash)) do
    local key = ARGV[7] .. id
    local m = {}
    if redis.call('TYPE', key).ok == 'hash' then
      m = redis.call('HMGET', key, 'state', 'total', 'completed', 'failed', 'cancelled')
    end
    if m[1] == 'validating' or m[1] == 'in_progress' or m[1] == 'cancelling' then
      open = open + (tonumber(m[2]) or 0) - (tonumber(m[3]) or 0) - (tonumber(m[4]) or 0)
        - (tonumber(m[5]) or 0)
    else
      redis.call('HDEL', hash, id)
    end
  end
  return open
end
local lines = tonumber(ARGV[6])
local tenant_cap = tonumber(ARGV[8])
if KEYS[4] ~= '' and tenant_cap >= 0 then
  local open = open_lines(KEYS[4])
  if open + lines > tenant_cap then return {'tenant_full', tostring(open)} end
end
local cap = tonumber(ARGV[5])
if cap >= 0 then
  local open = open_lines(KEYS[3])
  if open + lines > cap then return {'full', tostring(open)} end
end
redis.call('HSET', KEYS[1], 'fingerprint', ARGV[2], unpack(ARGV, 9))
redis.call('EXPIREAT', KEYS[1], at)
redis.call('ZADD', KEYS[2], now, ARGV[1])
if redis.call('EXPIRETIME', KEYS[2]) < at then redis.call('EXPIREAT', KEYS[2], at) end
for _, open in ipairs({KEYS[3], KEYS[4]}) do
  if open ~= '' then
    redis.call('HSET', open, ARGV[1], now)
    if redis.call('EXPIRETIME', open) < at then redis.call('EXPIREAT', open, at) end
  end
end
return {'created'}
