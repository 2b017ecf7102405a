-- KEYS: file, the creator's files
-- ARGV: TTL, most files, most bytes, this file's size, file key prefix, file id, then field,
-- value, ...
-- Stores an uploaded file unless its creator would pass a limit. Returns {'ok'}, or
-- {'files', files kept} / {'bytes', bytes kept} (nothing written). Files that expired leave the
-- creator's hash here, so the limits count only what Redis still holds.
local kept, used = 0, 0
local files = redis.call('HGETALL', KEYS[2])
for i = 1, #files, 2 do
  if redis.call('EXISTS', ARGV[5] .. files[i]) == 1 then
    kept = kept + 1
    used = used + (tonumber(files[i + 1]) or 0)
  else
    redis.call('HDEL', KEYS[2], files[i])
  end
end
if kept + 1 > tonumber(ARGV[2]) then return {'files', tostring(kept)} end
if used + tonumber(ARGV[4]) > tonumber(ARGV[3]) then return {'bytes', tostring(used)} end
redis.call('HSET', KEYS[1], unpack(ARGV, 7))
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[6], ARGV[4])
if redis.call('TTL', KEYS[2]) < tonumber(ARGV[1]) then redis.call('EXPIRE', KEYS[2], ARGV[1]) end
return {'ok'}
