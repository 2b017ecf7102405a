"""Liveness and recovery: the heartbeat thread, the reaper of dead workers' jobs, RQ's
housekeeping, and the watchdog of a hung loop."""
