#!/usr/bin/env python3
"""Benchmarks for `fleet serve`; prints a table and writes JSON.

1. Streaming users (closed loop, greedy, same prompts) against
   - the gateway's /v1/completions (SSE) in front of one in-process fleet worker,
   - llama-server -np USERS's own /v1/completions (SSE),
   - the Python API (Fleet.submit + stream) on the same worker: the gateway's overhead.
2. Slow clients: C streaming requests held open by clients that read one chunk a second, while
   /health is probed every 20 ms; /health latency percentiles and the gateway's RSS.

    .venv/bin/python scripts/bench_gateway.py --users 16 --slow-clients 1000 --out bench-gateway.json
    .venv/bin/python scripts/bench_gateway.py --users 4 --requests-per-user 1 --slow-clients 50 \\
        --slow-seconds 5                                          # a quick check that it all runs

Every process it starts (redis-server, worker, fleet serve, llama-server) is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from rich.console import Console

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ecosystem.local.bench import PROMPTS, machine_meta  # noqa: E402
from ecosystem.local.bench_load import CompletionsTarget, FleetTarget, Target, closed_loop  # noqa: E402
from ecosystem.local.bench_report import FLEET, PEER, Run, percentile, summarise, table  # noqa: E402
from ecosystem.local.bench_workloads import unmeasured  # noqa: E402
from ecosystem.local.llama_server import start_llama_server  # noqa: E402
from ecosystem.local.processes import RedisServer, start_gateway, start_worker, wait_until_healthy  # noqa: E402


def measure(args: argparse.Namespace, role: str, name: str, target: Target, prompts: list[str],
            round_no: int = 0) -> Run:
    closed_loop(target, args.users, 1, unmeasured(prompts, 8))  # warm-up: every slot once, off the clock
    load = closed_loop(target, args.users, args.requests_per_user, unmeasured(prompts, args.max_tokens))
    return Run.of(args.users, role, name, round_no, load, {})


def median_ratio(runs: list[Run], a: str, b: str) -> float | None:
    """Median over rounds of system a's tok/s over system b's (each round ran both seconds apart)."""
    ratios = []
    for rnd in sorted({r.round for r in runs}):
        tok_s = {r.system: summarise([r]).tok_s for r in runs if r.round == rnd}
        if tok_s.get(a) and tok_s.get(b):
            ratios.append(tok_s[a] / tok_s[b])
    return round(statistics.median(ratios), 3) if ratios else None


async def slow_clients(url: str, clients: int, seconds: float, gateway_pid: int) -> dict[str, Any]:
    """`clients` open streams read one chunk a second; /health probed every 20 ms meanwhile."""
    limits = httpx.Limits(max_connections=clients + 10, max_keepalive_connections=clients + 10)
    opened = 0
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(seconds + 60), limits=limits) as client:

        async def reader(i: int) -> None:
            nonlocal opened
            body = {"model": "llm", "prompt": f"Story {i}: once upon a time", "max_tokens": 64,
                    "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                opened += response.status_code == 200
                async for _ in response.aiter_raw(64):
                    await asyncio.sleep(1.0)  # a slow client: one small read a second

        readers = [asyncio.create_task(reader(i)) for i in range(clients)]
        async with httpx.AsyncClient(base_url=url, timeout=10) as probe:
            deadline = time.monotonic() + 60
            while opened < clients and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            latencies, failures = [], 0
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                t0 = time.perf_counter()
                failures += (await probe.get("/health")).status_code != 200
                latencies.append((time.perf_counter() - t0) * 1000)
                await asyncio.sleep(0.02)
            rss_mib = psutil.Process(gateway_pid).memory_info().rss / 2**20
        for task in readers:  # the clients leave: their jobs are cancelled
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    return {"clients": clients, "streams_open": opened, "probes": len(latencies), "probe_failures": failures,
            "health_p50_ms": percentile(latencies, 50), "health_p99_ms": percentile(latencies, 99),
            "health_max_ms": max(latencies, default=None), "gateway_rss_mib": round(rss_mib, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--requests-per-user", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=len(psutil.Process().cpu_affinity() or [0, 1]))
    parser.add_argument("--rounds", type=int, default=1, help="each round runs the three systems, "
                        "in an order that rotates every round")
    parser.add_argument("--slow-clients", type=int, default=1000)
    parser.add_argument("--slow-seconds", type=float, default=20.0)
    parser.add_argument("--out", default="bench-gateway.json")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # a socket per slow client, both ends
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * args.slow_clients + 1024)), hard))
    console = Console() if sys.stdout.isatty() else Console(width=150)  # a log file: room for the table
    prompts = list(PROMPTS)
    ctx = 1024
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp, contextlib.ExitStack() as stack:
        logs = Path(tmp) / "logs"
        redis = stack.enter_context(RedisServer.start(Path(tmp) / "redis"))
        console.log(f"fleet worker: llama-cpp, {args.users} slots; fleet serve; "
                    f"llama-server -np {args.users}")
        worker = start_worker(redis.url, "bench-w1", logs, timeout=180, backend__slots=args.users,
                              backend__n_ctx_per_seq=ctx, backend__threads=args.threads)
        stack.callback(worker.stop)
        gw = start_gateway(redis.url, logs, gateway__max_queue=args.slow_clients + 100)
        stack.callback(gw.stop)
        wait_until_healthy(gw, 60)
        gateway_target = CompletionsTarget(gw.url, args.users, seed=0)
        gateway_name, api_name = "fleet serve /v1/completions", "Python API (Fleet)"
        peer_name = f"llama-server -np {args.users} /v1/completions"
        with start_llama_server(logs, parallel=args.users, ctx=args.users * ctx,
                                threads=args.threads) as server:  # stopped before the slow clients
            systems: list[tuple[str, str, Target]] = [
                (FLEET, gateway_name, gateway_target), ("python-api", api_name, FleetTarget(redis.url)),
                (PEER, peer_name, CompletionsTarget.llama_server(server.url, args.users, seed=0))]
            for rnd in range(args.rounds):
                for role, name, target in systems[rnd % 3:] + systems[:rnd % 3]:
                    runs.append(measure(args, role, name, target, prompts, rnd))
                    console.log(f"round {rnd}: {name}: {summarise([runs[-1]]).tok_s:.1f} tok/s")
        names = (gateway_name, api_name, peer_name)
        rows = [summarise([r for r in runs if r.system == name]) for name in names]
        console.print(table(rows, f"{args.users} streaming users, {args.max_tokens} tokens, greedy, "
                                  f"{args.rounds} round(s)"))
        gw_row, api_row, peer_row = rows
        ratios = {"gateway_vs_llama_server_tok_s": _ratio(gw_row.tok_s, peer_row.tok_s),
                  "gateway_vs_llama_server_tok_s_median_of_rounds":
                      median_ratio(runs, gateway_name, peer_name),
                  "gateway_vs_llama_server_ttft_p95": _ratio(gw_row.ttft_p95_ms, peer_row.ttft_p95_ms),
                  "gateway_vs_python_api_tok_s": _ratio(gw_row.tok_s, api_row.tok_s),
                  "gateway_vs_python_api_tok_s_median_of_rounds": median_ratio(runs, gateway_name, api_name)}
        console.print(ratios)
        console.log(f"{args.slow_clients} slow streaming clients, /health probed for {args.slow_seconds:g}s")
        slow = asyncio.run(slow_clients(gw.url, args.slow_clients, args.slow_seconds, gw.process.pid))
        console.print(slow)
    out = {"meta": {**machine_meta(), "args": vars(args)}, "rows": [r.__dict__ for r in rows],
           "ratios": ratios, "slow_clients": slow}
    Path(args.out).write_text(json.dumps(out, indent=2, default=str))
    console.log(f"wrote {args.out}")


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


if __name__ == "__main__":
    main()
