-- KEYS: state, index, open batches of the pool
-- ARGV: batch id, fingerprint, expire-at, now, most open lines in the pool (-1: no cap), this
-- batch's lines, state key prefix, then field, value, ...
-- Creates the batch unless it exists. Returns {'exists', fingerprint, state}, {'full', open lines
-- of the pool's other batches} (nothing written), or {'created'}.
-- The expire-at is checked before any write, so no error can leave the record without a TTL.
-- The cap counts the lines not ended yet of every open batch of the pool (validating,
-- in_progress, cancelling); ended or expired batches leave the open hash here.
if redis.call('EXISTS', KEYS[1]) == 1 then
  local m = redis.call('HMGET', KEYS[1], 'fingerprint', 'state')
  return {'exists', m[1] or '', m[2] or ''}
end
local at, now = tonumber(ARGV[3]), tonumber(ARGV[4])
if not at or not now or at ~= math.floor(at) or at <= now or at > now + 400 * 86400 then
  return redis.error_reply('ERR batch expire-at out of range: ' .. ARGV[3])
end
local cap, lines = tonumber(ARGV[5]), tonumber(ARGV[6])
if cap >= 0 then
  local open = 0
  local ids = redis.call('HKEYS', KEYS[3])
  for _, id in ipairs(ids) do
    local key = ARGV[7] .. id
    local m = {}
    if redis.call('TYPE', key).ok == 'hash' then
      m = redis.call('HMGET', key, 'state', 'total', 'completed', 'failed', 'cancelled')
    end
    if m[1] == 'validating' or m[1] == 'in_progress' or m[1] == 'cancelling' then
      open = open + (tonumber(m[2]) or 0) - (tonumber(m[3]) or 0) - (tonumber(m[4]) or 0)
        - (tonumber(m[5]) or 0)
    else
      redis.call('HDEL', KEYS[3], id)
    end
  end
  if open + lines > cap then return {'full', tostring(open)} end
end
redis.call('HSET', KEYS[1], 'fingerprint', ARGV[2], unpack(ARGV, 8))
redis.call('EXPIREAT', KEYS[1], at)
redis.call('ZADD', KEYS[2], now, ARGV[1])
if redis.call('EXPIRETIME', KEYS[2]) < at then redis.call('EXPIREAT', KEYS[2], at) end
redis.call('HSET', KEYS[3], ARGV[1], now)
if redis.call('EXPIRETIME', KEYS[3]) < at then redis.call('EXPIREAT', KEYS[3], at) end
return {'created'}
