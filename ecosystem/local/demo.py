"""`scripts/demo`: a private redis-server, one worker on the embedded model, 8 jobs at once.

Streams one job live, then prints every job's result and the aggregate throughput. Everything
it started is stopped at the end, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from backends.contract.schema import JobResult
from dispatcher.client import Fleet, FleetJob
from ecosystem.local.processes import RedisServer, start_worker

PROMPTS = [
    "Once upon a time, in a village by the sea,",
    "The three most important things about CPUs are",
    "Here is a short poem about Redis queues:",
    "A recipe for a quick tomato soup:",
    "The history of the printing press begins",
    "Ten tips for writing clear code:",
    "The spaceship drifted silently until",
    "Dear diary, today I learned that",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--slots", type=int, default=8)
    args = ap.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 140)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(130))  # run the finally blocks
    with tempfile.TemporaryDirectory(prefix="fleet-demo-") as tmp:
        redis = RedisServer.start(Path(tmp) / "redis")
        worker = None
        try:
            console.print(f"[bold]redis-server[/] on {redis.url}; starting one worker "
                          f"({args.slots} slots, embedded gemma-3-270m Q4_K_M) ...")
            worker = start_worker(redis.url, "demo-worker", Path(tmp) / "logs", backend__slots=args.slots)
            run(console, Fleet(redis.url), args)
        except KeyboardInterrupt:
            console.print("\n[yellow]interrupted[/]")
            return 130
        finally:
            if worker is not None:
                worker.stop()
            redis.stop()
            console.print("stopped the worker and redis-server")
    return 0


def run(console: Console, fleet: Fleet, args: argparse.Namespace) -> None:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.jobs)]
    t0 = time.monotonic()
    jobs = [fleet.submit(prompt=p, max_tokens=args.max_tokens, temperature=0.7, seed=i)
            for i, p in enumerate(prompts)]
    console.print(f"submitted {len(jobs)} jobs at once; streaming job 1 live:\n")
    console.print(f"[bold]{prompts[0]}[/]", end="")
    for text in jobs[0].stream(timeout=300):
        console.print(text, end="", markup=False, highlight=False)
    console.print("\n")
    results = [j.result(timeout=300) for j in jobs]
    wall = time.monotonic() - t0
    print_results(console, jobs, results, wall)


def print_results(console: Console, jobs: list[FleetJob], results: list[JobResult], wall: float) -> None:
    table = Table(title="results")
    for col in ("job", "worker", "tokens", "queue wait ms", "TTFT ms", "tok/s", "finish", "text"):
        is_text = col == "text"
        table.add_column(col, overflow="ellipsis", no_wrap=is_text, max_width=40 if is_text else None)
    for i, r in enumerate(results, 1):
        t = r["timings"]
        table.add_row(str(i), r["worker"], str(r["usage"]["completion_tokens"]), str(t["queue_ms"]),
                      str(t["ttft_ms"]), str(t["tokens_per_s"]), r["finish_reason"],
                      r["text"].replace("\n", " ").strip())
    console.print(table)
    total = sum(r["usage"]["completion_tokens"] for r in results)
    console.print(f"[bold]{len(results)} jobs, {total} tokens in {wall:.1f} s: "
                  f"{total / wall:.1f} tok/s aggregate[/]")


if __name__ == "__main__":
    sys.exit(main())
