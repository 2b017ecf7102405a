"""Test-side names for the local-fleet helpers (they live in ecosystem.local.processes), and the
repository root the tests run from."""

import signal
from pathlib import Path

from ecosystem.local.processes import RedisServer, WorkerProcess, start_worker, wait_for, worker_env

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["ROOT", "RedisServer", "WorkerProcess", "default_sigint", "start_worker", "wait_for", "worker_env"]


def default_sigint() -> None:
    """Popen preexec_fn for a Ctrl-C test: SIGINT back to its default in the child. A suite
    started in the background (`cmd &`, nohup) runs with SIGINT ignored, and an ignored signal
    stays ignored across exec, so the CLI under test would never see the test's SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
