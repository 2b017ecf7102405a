"""Real PM2 for tests: installed on first use by scripts/install-pm2 (cached), run with a private
PM2_HOME so a test's daemon never meets the user's or another test's."""

from __future__ import annotations

import functools
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


@functools.cache
def pm2_binary() -> str:
    """$PM2 if set, else the pinned PM2 from scripts/install-pm2 (which also installs Node.js)."""
    if os.environ.get("PM2"):
        return os.environ["PM2"]
    proc = subprocess.run(
        [str(REPO / "scripts" / "install-pm2")], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"scripts/install-pm2 failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout.strip().splitlines()[-1]


@dataclass
class Pm2:
    home: Path  # keep it short: PM2 puts its unix sockets here

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PM2_HOME": str(self.home)}
        return subprocess.run([pm2_binary(), *args], capture_output=True, text=True, env=env, timeout=timeout)

    def check(self, *args: str, timeout: float = 120) -> str:
        proc = self.run(*args, timeout=timeout)
        assert proc.returncode == 0, f"pm2 {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout

    def apps(self) -> dict[str, dict[str, Any]]:
        """`pm2 jlist` by app name."""
        return {a["name"]: a for a in json.loads(self.check("jlist"))}

    def kill(self) -> None:
        """Stop every app and the PM2 daemon (test teardown)."""
        self.run("kill")
