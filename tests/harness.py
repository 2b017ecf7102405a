"""Test-side names for the local-fleet helpers (they live in ecosystem.local.processes), and the
repository root the tests run from."""

from pathlib import Path

from ecosystem.local.processes import RedisServer, WorkerProcess, start_worker, wait_for, worker_env

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["ROOT", "RedisServer", "WorkerProcess", "start_worker", "wait_for", "worker_env"]
