-- KEYS: state, lines   ARGV: now   (loaded after backends/contract/batch/settle_function.lua)
-- Ends the batch if every enqueued line has ended. Returns 2 when it ended now, else 1.
return settle(KEYS[1], KEYS[2], ARGV[1])
