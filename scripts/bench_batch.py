#!/usr/bin/env python3
"""Interactive latency beside a low-priority batch, batch throughput, Redis bytes per batch line.

    .venv/bin/python scripts/bench_batch.py --lines 2000 --users 8 --out bench_batch.json

1. idle fleet: `--users` interactive users at high priority, each `--requests` streamed requests
   one after another; TTFT = submit to first token.
2. the same users while a `--lines` batch (low priority) runs on the same workers.
3. Redis memory: used_memory per line while the batch is queued, and the batch record's bytes per
   line once it ended (MEMORY USAGE of its lines hash).
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from backends.contract.keys import batch_lines_key
from dispatcher.client import Fleet
from dispatcher.gateway.batch import record
from dispatcher.gateway.batch.submit import BatchSpec, submit_batch
from ecosystem.local.processes import RedisServer, start_worker, wait_for


def batch_lines(n: int, max_tokens: int) -> list[str]:
    return [json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                        "body": {"model": "llm", "prompt": f"Write a short note about item {i}.",
                                 "max_tokens": max_tokens, "temperature": 0}}) for i in range(n)]


def users_ttft(fleet: Fleet, users: int, requests: int, max_tokens: int) -> list[float]:
    """Closed loop: each user sends `requests` streamed high-priority requests in turn."""
    ttfts: list[float] = []
    lock = threading.Lock()

    def user(u: int) -> None:
        for r in range(requests):
            t0 = time.monotonic()
            job = fleet.submit(f"User {u} asks question {r}: why is the sky blue?", priority="high",
                               max_tokens=max_tokens, temperature=0)
            for _ in job.stream(timeout=300, detach=True):  # detach: leaving the loop must not cancel
                with lock:
                    ttfts.append((time.monotonic() - t0) * 1000)
                break
            job.result(timeout=300)

    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ttfts


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1] if len(values) >= 2 else (values[0] if values else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--requests", type=int, default=5, help="requests per interactive user")
    ap.add_argument("--max-tokens", type=int, default=32, help="interactive requests")
    ap.add_argument("--batch-max-tokens", type=int, default=32)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--reserved", type=int, default=None, help="reserved_slots (default: the worker's)")
    ap.add_argument("--out", type=Path, default=Path("bench_batch.json"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    settings: dict[str, Any] = {"backend__slots": args.slots}
    if args.reserved is not None:
        settings["reserved_slots"] = args.reserved
    with RedisServer.start(tmp / "redis") as rs:
        workers = [start_worker(rs.url, f"bench-{i}", tmp / "logs", **settings) for i in range(args.workers)]
        try:
            report = run(rs, args)
        finally:
            for w in workers:
                w.kill()
    show(report)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


def run(rs: RedisServer, args: argparse.Namespace) -> dict[str, Any]:
    redis = rs.client()
    fleet = Fleet(rs.url)
    users_ttft(fleet, 1, 1, 4)  # warm up
    idle = users_ttft(fleet, args.users, args.requests, args.max_tokens)

    lines = batch_lines(args.lines, args.batch_max_tokens)
    before = int(redis.info("memory")["used_memory"])
    spec = BatchSpec("bench", "llm", "low")
    t0 = time.monotonic()
    submit_batch(redis, spec, lambda: lines)
    enqueue_s = time.monotonic() - t0
    queued_bytes = (int(redis.info("memory")["used_memory"]) - before) / args.lines
    wait_for(lambda: int(redis.hget("fleet:batch:bench", "completed") or 0) >= 1, 300, "the batch to start")
    tokens0, t_busy = (record.read_state(redis, "bench") or {})["completion_tokens"] or 0, time.monotonic()
    busy = users_ttft(fleet, args.users, args.requests, args.max_tokens)
    state = record.read_state(redis, "bench") or {}
    tokens1, t_end = state["completion_tokens"] or 0, time.monotonic()
    wait_for(lambda: (record.read_state(redis, "bench") or {}).get("state") == "completed", 7200,
             "the batch to end", interval=1.0)
    final = record.read_state(redis, "bench") or {}
    batch_s = final["completed_at"] - final["created_at"]
    record_bytes = int(redis.memory_usage(batch_lines_key("bench")) or 0) / args.lines
    return {
        "lines": args.lines, "users": args.users, "requests_per_user": args.requests, "workers": args.workers,
        "slots": args.slots, "reserved_slots": args.reserved,
        "ttft_idle_ms": {"p50": statistics.median(idle), "p95": p95(idle), "n": len(idle)},
        "ttft_beside_batch_ms": {"p50": statistics.median(busy), "p95": p95(busy), "n": len(busy)},
        "ttft_p95_ratio": p95(busy) / p95(idle) if idle else None,
        "batch_tok_s_beside_users": (tokens1 - tokens0) / max(t_end - t_busy, 1e-9),
        "batch_tok_s_overall": (final["completion_tokens"] or 0) / max(batch_s, 1),
        "batch_seconds": batch_s, "enqueue_seconds": enqueue_s,
        "redis_bytes_per_queued_line": queued_bytes, "redis_bytes_per_line_record": record_bytes,
        "completed": final["completed"], "failed": final["failed"],
    }


def show(r: dict[str, Any]) -> None:
    table = Table(title=f"batch of {r['lines']} lines beside {r['users']} interactive users")
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("TTFT p50 / p95, idle fleet (ms)",
         f"{r['ttft_idle_ms']['p50']:.0f} / {r['ttft_idle_ms']['p95']:.0f}"),
        ("TTFT p50 / p95, beside the batch (ms)",
         f"{r['ttft_beside_batch_ms']['p50']:.0f} / {r['ttft_beside_batch_ms']['p95']:.0f}"),
        ("TTFT p95 ratio", f"{r['ttft_p95_ratio']:.2f}x"),
        ("batch tok/s beside the users", f"{r['batch_tok_s_beside_users']:.1f}"),
        ("batch tok/s overall", f"{r['batch_tok_s_overall']:.1f}"),
        ("batch wall time (s)", f"{r['batch_seconds']}"),
        ("enqueue time (s)", f"{r['enqueue_seconds']:.2f}"),
        ("Redis bytes per queued line", f"{r['redis_bytes_per_queued_line']:.0f}"),
        ("Redis bytes per line, batch record", f"{r['redis_bytes_per_line_record']:.0f}"),
        ("lines completed / failed", f"{r['completed']} / {r['failed']}"),
    ]
    for row in rows:
        table.add_row(*row)
    Console().print(table)


if __name__ == "__main__":
    main()
