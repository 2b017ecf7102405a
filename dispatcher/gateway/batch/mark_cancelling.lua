-- KEYS: state   ARGV: now
-- validating / in_progress -> cancelling. Returns the state before.
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'validating' or state == 'in_progress' then
  redis.call('HSET', KEYS[1], 'state', 'cancelling', 'cancelling_at', ARGV[1])
end
return state
