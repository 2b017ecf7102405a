"""What a claim costs with balance and placement, at a deep queue: a private redis-server holds
N queued job ids (default 1,000,000) and two registered workers; one worker claims jobs one at a
time (a worker with one free slot, the most frequent claim) in four cases:

- plain: no job carries prefix keys (only balance's reads);
- placement off: every job is held by the other worker, claims blind to it (`placement: false`);
- held elsewhere: every job's prefix is held by the other, live worker with free slots, so each
  claim looks ahead through 8 jobs and finds nothing (the worst case: a claim that takes none);
- mine: every job's prefix is held by the claiming worker.

Prints microseconds per claim (median and p99 of the EVALSHA round trip, client side) and
writes JSON.

    .venv/bin/python scripts/bench_claim.py --queued 1000000 --claims 2000 --out claim.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.contract.affinity import FIELD, held_key  # noqa: E402
from backends.contract.keys import job_key, queue_key  # noqa: E402
from ecosystem.local.bench import machine_meta  # noqa: E402
from ecosystem.local.processes import RedisServer  # noqa: E402
from worker.claiming.claim import Claimer  # noqa: E402

POOL, QUEUE = "llm", "llm:default"
HELD = "ab" * 12


def fill(redis: RedisServer, queued: int, keyed: int) -> None:
    """`queued` ids on the queue; the first `keyed` get job hashes carrying one prefix key."""
    r = redis.client()
    r.flushall()
    chunk = 10_000
    for start in range(0, queued, chunk):
        ids = [f"job-{i}" for i in range(start, min(queued, start + chunk))]
        pipe = r.pipeline(transaction=False)
        pipe.rpush(queue_key(QUEUE), *ids)
        for job_id in ids[: max(0, keyed - start)]:
            pipe.hset(job_key(job_id), mapping={"status": "queued", FIELD: HELD})
        pipe.execute()


def timed(claimer: Claimer, claims: int) -> tuple[list[float], int]:
    times, taken = [], 0
    for _ in range(claims):
        t0 = time.perf_counter()
        taken += len(claimer.claim(4))
        times.append((time.perf_counter() - t0) * 1e6)
    return times, taken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queued", type=int, default=1_000_000)
    parser.add_argument("--claims", type=int, default=2000)
    parser.add_argument("--out", default="bench-claim.json")
    args = parser.parse_args()
    console = Console()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp, RedisServer.start(Path(tmp)) as redis:
        r = redis.client()
        for case in ("plain", "placement off", "held elsewhere", "mine"):
            keyed = 0 if case == "plain" else args.claims * 16 + 64
            console.log(f"{case}: filling {args.queued:,} ids ({keyed:,} with prefix keys)")
            fill(redis, args.queued, keyed)
            me = Claimer(r, "me", [QUEUE], slots=64, placement=case != "placement off")
            other = Claimer(r, "other", [QUEUE], slots=64)
            me.claim(0), other.claim(0)
            if case != "plain":
                r.set(held_key(POOL, HELD), "me" if case == "mine" else "other")
            r.hset(f"fleet:capacity:{POOL}", mapping={"me": f"64|64|{int(time.time() * 1000)}"})
            times, taken = [], 0
            for _ in range(args.claims // 100):
                # both workers stay live and idle-looking: refresh the other's entry as its polls would
                sec, usec = r.time()
                r.hset(f"fleet:capacity:{POOL}", "other", f"64|64|{sec * 1000 + usec // 1000}")
                t, n = timed(me, 100)
                times += t
                taken += n
                r.delete("fleet:inflight:me")
            times.sort()
            rows[case] = {"median_us": round(statistics.median(times), 1),
                          "p99_us": round(times[int(0.99 * len(times))], 1), "jobs_taken": taken,
                          "queue_left": r.llen(queue_key(QUEUE))}
            console.log(f"{case}: {rows[case]}")
    table = Table(title=f"claim(4) round trip with {args.queued:,} jobs queued ({args.claims} claims)")
    for col in ("case", "median µs", "p99 µs", "jobs taken"):
        table.add_column(col)
    for case, row in rows.items():
        table.add_row(case, f"{row['median_us']:.0f}", f"{row['p99_us']:.0f}", str(row["jobs_taken"]))
    console.print(table)
    report = {"machine": machine_meta(), "args": vars(args), "cases": rows}
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
