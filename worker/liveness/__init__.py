"""Liveness and recovery: the heartbeat thread, the reaper of dead workers' jobs, RQ's
housekeeping, and the worker's view of its Redis link through an outage."""
