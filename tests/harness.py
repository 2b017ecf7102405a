"""Test-side names for the local-fleet helpers (they live in dispatcher.local)."""

from dispatcher.local import ROOT, RedisServer, WorkerProcess, start_worker, wait_for, worker_env

__all__ = ["ROOT", "RedisServer", "WorkerProcess", "start_worker", "wait_for", "worker_env"]
