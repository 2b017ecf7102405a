"""Submit latency per durability mode: N submits each with durability "primary" and "replicated"
against a real redis-server primary with one replica on loopback; prints p50/p99 and writes JSON.

    .venv/bin/python scripts/bench_durability.py --submits 1000 --out durability.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dispatcher import Fleet  # noqa: E402
from ecosystem.local.processes import RedisServer, wait_for  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--submits", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, RedisServer.start(Path(tmp) / "primary") as primary:
        replica = RedisServer.start(Path(tmp) / "replica",
                                    extra=["--replicaof", "127.0.0.1", str(primary.port)])
        try:
            wait_for(lambda: replica.client().info("replication").get("master_link_status") == "up", 20,
                     "the replica to sync")
            report = {}
            for mode in ("primary", "replicated"):
                fleet = Fleet(primary.url, durability=mode)  # type: ignore[arg-type]
                fleet.submit("warm up", max_tokens=1)
                took = []
                for i in range(args.submits):
                    t = time.perf_counter()
                    fleet.submit(f"job {i}", max_tokens=8)
                    took.append((time.perf_counter() - t) * 1000)
                report[mode] = {"submits": args.submits, "p50_ms": round(statistics.median(took), 3),
                                "p99_ms": round(percentile(took, 0.99), 3), "max_ms": round(max(took), 3)}
                print(f"{mode:>10}: p50 {report[mode]['p50_ms']:.3f} ms, p99 {report[mode]['p99_ms']:.3f} ms"
                      f" ({args.submits} submits)")
        finally:
            replica.stop()
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
