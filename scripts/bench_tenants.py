"""Fair share between tenants, measured: one real `fleet worker` on the embedded model, tenant B's
closed-loop interactive users (default priority), alone and while tenant A has a big backlog
queued at the same priority (equal weights, then B weighted 3); the FIFO case (nobody names a
tenant) for contrast. Prints a table and writes JSON.

    .venv/bin/python scripts/bench_tenants.py --backlog 2000 --users 8 --out tenants.json

B's TTFT is measured as a user sees it: from submit to the first text delta of the stream.
A's throughput is A's completed tokens per second while B's users run. `--think-ms` gives B's
users a think time before each request (exponential, that mean, seeded): without it the 8 users
start together and, with equal answers, stay in lockstep, so every request meets 7 others'
prompts in the same step (the worst case, and the default).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import threading
import time
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

PROMPTS = [f"Tell me one short fact about {t}." for t in (
    "the moon", "bread", "rivers", "owls", "copper", "tea", "glass", "snow")]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def interactive(fleet: Fleet, tenant: str | None, users: int, requests: int, tokens: int,
                think_ms: float = 0.0) -> list[float]:
    """`users` closed-loop users, `requests` each, thinking ~think_ms before each: TTFT of every
    request (ms)."""
    ttfts: list[float] = []
    lock = threading.Lock()
    named: dict[str, Any] = {"tenant": tenant} if tenant else {}

    def user(u: int) -> None:
        thinking = random.Random(u)
        for r in range(requests):
            if think_ms:
                time.sleep(thinking.expovariate(1000 / think_ms))
            started = time.perf_counter()
            job = fleet.submit(prompt=PROMPTS[(u + r) % len(PROMPTS)], max_tokens=tokens, **named)
            first = None
            for _delta in job.stream(timeout=600):
                if first is None:
                    first = time.perf_counter() - started
            with lock:
                ttfts.append((first if first is not None else time.perf_counter() - started) * 1000)

    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ttfts


def completed_tokens(fleet: Fleet, ids: list[str]) -> int:
    """Completion tokens of A's jobs that have ended (a cheap read of each one's status first)."""
    total = 0
    for job_id in ids:
        job = fleet.job(job_id)
        if job.status() == "finished":
            total += job.result(timeout=5).usage.completion_tokens
    return total


def scenario(name: str, backlog: int, users: int, requests: int, tokens: int, tenants: bool,
             weights: dict[str, float], logs: Path, think_ms: float = 0.0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, RedisServer.start(Path(tmp)) as redis:
        settings: dict[str, Any] = {"gateway__tenants": {t: {"weight": w} for t, w in weights.items()}}
        worker = start_worker(redis.url, f"bench-{name}", logs, **settings)
        try:
            fleet = Fleet(redis.url)
            fleet.submit(prompt="warm up", max_tokens=4).result(timeout=120)
            a_named: dict[str, Any] = {"tenant": "a"} if tenants else {}
            a_ids = [fleet.submit(prompt=PROMPTS[i % len(PROMPTS)], max_tokens=tokens, **a_named).id
                     for i in range(backlog)]
            time.sleep(1.0 if backlog else 0)  # A's jobs fill the slots first
            before = completed_tokens(fleet, a_ids)
            started = time.monotonic()
            ttfts = interactive(fleet, "b" if tenants else None, users, requests, tokens, think_ms)
            took = time.monotonic() - started
            a_tok_s = (completed_tokens(fleet, a_ids) - before) / took if backlog else 0.0
        finally:
            worker.stop()
    return {"scenario": name, "backlog": backlog, "tenants": tenants, "weights": weights,
            "think_ms": think_ms,
            "b_requests": len(ttfts), "b_ttft_p50_ms": round(statistics.median(ttfts), 1),
            "b_ttft_p95_ms": round(percentile(ttfts, 0.95), 1), "b_seconds": round(took, 1),
            "a_tok_s_during_b": round(a_tok_s, 1)}


@click.command()
@click.option("--backlog", default=2000, show_default=True, help="jobs tenant A queues")
@click.option("--fifo-backlog", default=300, show_default=True,
              help="A's backlog in the FIFO contrast (0: skip)")
@click.option("--users", default=8, show_default=True)
@click.option("--requests", default=4, show_default=True, help="per user")
@click.option("--tokens", default=32, show_default=True, help="max_tokens of every job")
@click.option("--think-ms", default=0.0, show_default=True,
              help="B's users' mean think time before each request (0: lockstep)")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=Path("bench-tenants.json"))
def main(backlog: int, fifo_backlog: int, users: int, requests: int, tokens: int, think_ms: float,
         out: Path) -> None:
    console = Console()
    logs = Path(tempfile.mkdtemp(prefix="bench-tenants-"))
    plan: list[tuple[str, int, bool, dict[str, float]]] = [
        ("B alone", 0, True, {}), ("B beside A, 1:1", backlog, True, {}),
        ("B beside A, B weight 3", backlog, True, {"b": 3.0})]
    if fifo_backlog:
        plan.append(("FIFO, no tenants", fifo_backlog, False, {}))
    rows: list[dict[str, Any]] = []
    for name, size, tenants, weights in plan:
        console.log(f"[bold]{name}[/]: backlog {size}, {users} users x {requests} requests")
        rows.append(scenario(name.split(",")[0].replace(" ", "-") + str(len(rows)), size, users, requests,
                             tokens, tenants, weights, logs, think_ms) | {"scenario": name})
        console.log(rows[-1])
    alone = rows[0]["b_ttft_p95_ms"]
    table = Table(title=f"tenant B's TTFT beside tenant A's backlog ({users} users, {tokens} tokens a job)")
    columns = ("scenario", "A's backlog", "B TTFT p50 ms", "B TTFT p95 ms", "p95 / alone",
               "A tok/s meanwhile")
    for col in columns:
        table.add_column(col, justify="left" if col == "scenario" else "right")
    for r in rows:
        r["p95_vs_alone"] = round(r["b_ttft_p95_ms"] / alone, 2)
        table.add_row(r["scenario"], str(r["backlog"]), f"{r['b_ttft_p50_ms']:.0f}",
                      f"{r['b_ttft_p95_ms']:.0f}", f"{r['p95_vs_alone']:.2f}x",
                      f"{r['a_tok_s_during_b']:.1f}")
    console.print(table)
    out.write_text(json.dumps({"machine": machine_meta(), "rows": rows}, indent=1))
    console.print(f"JSON: {out}")


if __name__ == "__main__":
    main()
