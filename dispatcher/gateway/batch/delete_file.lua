-- KEYS: file, the creator's files   ARGV: file id, creator
-- Deletes the file if this creator made it. Returns 1 if deleted, else 0.
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
