"""A burst onto idle workers, measured: N real `fleet worker` processes on the embedded model,
each pinned to one core (two per core when N exceeds the cores), idle; J jobs submitted at once
through the Python API. Wall time from the first submit to the last result, and how the jobs
split, for the fleet as it claims (balance at the claim) and for the same fleet forced to split
evenly (each worker's slots capped at J/N), in ABBA order per round. Prints a table, writes JSON.

    .venv/bin/python scripts/bench_spread.py --workers 2 --jobs 8 --rounds 3 --out spread.json
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dispatcher import Fleet  # noqa: E402
from ecosystem.local.bench import machine_meta  # noqa: E402
from ecosystem.local.processes import RedisServer, start_worker  # noqa: E402

TOPICS = ["the moon", "bread", "rivers", "owls", "copper", "tea", "glass", "snow"]


def burst(workers: int, jobs: int, slots: int, tokens: int, logs: Path) -> dict[str, Any]:
    """One burst on a fresh Redis and fresh workers: wall seconds and jobs per worker."""
    cores = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp, RedisServer.start(Path(tmp)) as redis:
        procs = [start_worker(redis.url, f"w{i}", logs, cpus=str(cores[i % len(cores)]),
                              backend__slots=slots, backend__threads=1) for i in range(workers)]
        try:
            fleet = Fleet(redis.url)
            warm = [fleet.submit(prompt="Hi", max_tokens=2) for _ in range(workers)]
            for job in warm:
                job.result(timeout=120)
            time.sleep(1.0)  # every worker idle and polling again
            started = time.perf_counter()
            submitted = [fleet.submit(prompt=f"Write a sentence about {TOPICS[i % len(TOPICS)]}.",
                                      max_tokens=tokens, temperature=0.0) for i in range(jobs)]
            results = [job.result(timeout=600) for job in submitted]
            wall = time.perf_counter() - started
        finally:
            for p in procs:
                p.stop()
    split = Counter(r["worker"] for r in results)
    return {"wall_s": round(wall, 3), "split": sorted(split.values(), reverse=True),
            "completion_tokens": sum(r["usage"]["completion_tokens"] for r in results)}


@click.command()
@click.option("--workers", default=2, show_default=True)
@click.option("--jobs", default=8, show_default=True)
@click.option("--slots", default=8, show_default=True, help="each worker's slots (as claimed)")
@click.option("--tokens", default=48, show_default=True)
@click.option("--rounds", default=3, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=None)
def main(workers: int, jobs: int, slots: int, tokens: int, rounds: int, out: Path | None) -> None:
    console = Console()
    forced = math.ceil(jobs / workers)
    runs: dict[str, list[dict[str, Any]]] = {"fleet": [], "forced split": []}
    with tempfile.TemporaryDirectory() as logs:
        for r in range(rounds):
            order = ["fleet", "forced split"] if r % 2 == 0 else ["forced split", "fleet"]
            for name in order:
                run = burst(workers, jobs, slots if name == "fleet" else forced, tokens, Path(logs))
                runs[name].append(run)
                console.print(f"round {r + 1} {name}: {run['wall_s']} s, split {run['split']}")
    ratios = [a["wall_s"] / b["wall_s"] for a, b in zip(runs["fleet"], runs["forced split"], strict=True)]
    table = Table(title=f"{jobs} jobs onto {workers} idle 1-core workers ({slots} slots each)")
    for col in ("claiming", "wall s (median)", "splits"):
        table.add_column(col)
    for name, rs in runs.items():
        table.add_row(name, f"{statistics.median(x['wall_s'] for x in rs):.2f}",
                      " ".join("/".join(map(str, x["split"])) for x in rs))
    console.print(table)
    median = statistics.median(ratios)
    console.print(f"fleet / forced split wall time: median of per-round ratios {median:.3f}x")
    report = {"machine": machine_meta(), "workers": workers, "jobs": jobs, "slots": slots, "tokens": tokens,
              "runs": runs, "ratio_per_round": [round(x, 3) for x in ratios],
              "ratio_median": round(statistics.median(ratios), 3)}
    if out:
        out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
