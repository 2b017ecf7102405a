"""The figures docs/ARCHITECTURE.md quotes come from the script that measures them: one job's path
on the real engine and the worker's tree (scripts/job_path.py --check-docs fails when they drift)."""

from __future__ import annotations

import subprocess
import sys

from tests.harness import ROOT


def test_architecture_quotes_what_job_path_measures_now() -> None:
    done = subprocess.run([sys.executable, "scripts/job_path.py", "--check-docs"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
