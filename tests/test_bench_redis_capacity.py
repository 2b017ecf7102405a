"""scripts/bench_redis_capacity.py end to end at its smallest: one fake worker with 2 slots behind
`fleet serve`, a few 4-token jobs, the claim probe on a short queue (a few seconds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# alone: a benchmark run; its claim probe must time claims at depth before the load starts
@pytest.mark.alone
def test_tiny_run_measures_redis_cpu_per_token(tmp_path: Path) -> None:
    out = tmp_path / "capacity.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_redis_capacity.py"), "--workers", "1", "--slots", "2",
         "--rounds", "3", "--max-tokens", "4", "--idle", "0.3", "--depth", "200", "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    [level] = report["levels"]
    assert level["errors"] == 0 and level["jobs_ok"] == 6
    assert level["tokens"] == 6 * 4
    assert level["redis_cpu_s"] > 0 and level["gateway_ms_per_1k_tokens"] > 0
    assert level["claims_took"] > 0 and level["claim_at_depth_p99_ms"] > 0
    assert level["derived"]["workers_per_redis_core"] > 0
