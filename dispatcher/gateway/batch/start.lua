-- KEYS: state, lines   ARGV: now   (loaded after backends/contract/batch/settle_function.lua)
-- Every line is enqueued: validating -> in_progress (unless cancelled meanwhile), then settle.
-- Returns the state.
if redis.call('HGET', KEYS[1], 'state') == 'validating' then
  redis.call('HSET', KEYS[1], 'state', 'in_progress', 'in_progress_at', ARGV[1])
end
settle(KEYS[1], KEYS[2], ARGV[1])
return redis.call('HGET', KEYS[1], 'state')
