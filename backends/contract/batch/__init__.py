"""What the producers (dispatcher/gateway/batch/) and the workers (worker/hooks/batch_hook.py)
agree on about a batch: how a line's job id names its batch and line, and how a line's ending is recorded
(line_record.py, record_end.lua, the shared Lua `settle` in settle_function.lua)."""
