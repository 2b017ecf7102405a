"""How many workers one Redis carries: redis-server's own CPU per 1,000 streamed tokens and per
job, with W fake workers streaming at a real per-slot token rate, and claim latency at depth while
they do.

One private redis-server (AOF on, `appendfsync everysec`, as docs/scale-out.md asks; `--no-aof`
for none), `fleet serve` (`--gateways` processes) and W `fleet worker` processes on the fake
engine (`--slots` 16 each, `step_delay` = 1 / `--rate`: one token per running job per step, so
~`--rate` tok/s per stream; `stream_interval` and every other worker setting at its default). An
asyncio client keeps `--oversubscribe` x W x slots OpenAI `/v1/completions` streams open
(closed loop: each user sends its next request when the last one ended) until W x slots x
`--rounds` jobs of `--max-tokens` tokens have ended (`--via api`: AsyncFleet.submit + its stream
hub in this process, as the gateway does, no HTTP). Workers are added level by level (1 → 2 → 4
...), on the same Redis.

CPU is CPU time, not wall time: redis-server's from `INFO cpu` (used_cpu_user + used_cpu_sys,
getrusage: microsecond resolution), the gateway's and workers' from psutil, each read before and
after a level. The Redis CPU charged to the fleet is the level's minus what Redis spent per
second with no worker at all (the gateways idle and the claim probe below), times the level's
duration. Each level also idles first for `--idle` s, which gives each worker's idle cost
(heartbeats, polls).

A probe process claims one job at a time (the queue model's CLAIM, as a worker with one free
slot does) every `--probe-every` s from a queue of another pool holding `--depth` job ids, so the
claim's round trip is timed on the loaded Redis: at depth, during every idle and load phase (wall
time, client side; it includes this box's scheduling). `--claim-bench` also runs
scripts/bench_claim.py --queued `--depth` on a quiet private Redis at the end.

`--short-tokens N` repeats level `--short-at` with N-token jobs: two job lengths on the same
fleet split Redis CPU into a part per job and a part per token (solved from the two).

Derived, printed under the table: workers one Redis core carries = 1 / (Redis CPU per token x
slots x tok/s per stream + a worker's idle cost) (the level's CPU per token; `--rate` per
stream, nominal), and the streams one `fleet serve` core carries from the gateway's CPU per token.
Results: docs/scale-out.md, "How many workers one Redis carries".

    .venv/bin/python scripts/bench_redis_capacity.py --workers 1,2,4,8 --rounds 5 \\
        --short-tokens 8 --claim-bench --out docs/bench-runs/2026-11-26-redis-capacity.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.contract.connect import redis_from_url  # noqa: E402
from backends.contract.keys import histogram_key, inflight_key, queue_key, worker_key  # noqa: E402
from backends.contract.observe_schema import SUM_FIELD  # noqa: E402
from dispatcher.aio import AsyncFleet  # noqa: E402
from ecosystem.local.bench import machine_meta  # noqa: E402
from ecosystem.local.processes import (  # noqa: E402
    GatewayProcess,
    RedisServer,
    WorkerProcess,
    start_gateway,
    start_worker,
    wait_for,
)

POOL = "llm"
PROBE_POOL, PROBE_WORKER = "probe", "probe-claimer"
PROMPT_WORDS = 512  # the fake engine emits the prompt's words: enough for any --max-tokens here


# -- CPU time -------------------------------------------------------------------------------------

def redis_cpu(r: Any) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def proc_cpu(pid: int, children: bool = True) -> float:
    """CPU seconds of a process and (unless `children` is false) its live children (psutil; 10 ms
    ticks)."""
    try:
        p = psutil.Process(pid)
        t = p.cpu_times()
        total = t.user + t.system
        for c in p.children(recursive=True) if children else []:
            try:
                ct = c.cpu_times()
                total += ct.user + ct.system
            except psutil.Error:
                pass
        return total
    except psutil.Error:
        return 0.0


def machine_busy() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, all CPU seconds) so far."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    total = sum(t)
    return total - idle, total


@dataclass
class Snapshot:
    wall: float
    redis: float
    gateways: float
    workers: float
    me: float
    probe: float
    busy: float
    total: float
    commands: dict[str, dict[str, float]]
    hists: dict[str, tuple[float, float]]  # the workers' histograms: metric -> (count, sum of s)


def snapshot(r: Any, gateways: list[GatewayProcess], workers: list[WorkerProcess],
             probe_pid: int) -> Snapshot:
    busy, total = machine_busy()
    stats = {k: {"calls": float(v["calls"]), "usec": float(v["usec"])}
             for k, v in r.info("commandstats").items()}
    hists = {}
    for metric in ("queue_wait", "ttft"):
        raw = {k.decode(): float(v) for k, v in r.hgetall(histogram_key(metric, POOL)).items()}
        hists[metric] = (sum(v for k, v in raw.items() if k != SUM_FIELD), raw.get(SUM_FIELD, 0.0))
    return Snapshot(time.perf_counter(), redis_cpu(r), sum(proc_cpu(g.process.pid) for g in gateways),
                    sum(proc_cpu(w.process.pid) for w in workers), proc_cpu(os.getpid(), children=False),
                    proc_cpu(probe_pid), busy, total, stats, hists)


# -- the claim probe (its own process: this one's event loop must not delay its timings) --------

def probe_main(url: str, every: float, conn: Connection) -> None:
    from worker.claiming.claim import Claimer

    r = redis_from_url(url)
    claimer = Claimer(r, PROBE_WORKER, [f"{PROBE_POOL}:default"], slots=16)
    samples: list[float] = []
    taken = 0
    beat = 0.0
    while True:
        if conn.poll():
            msg = conn.recv()
            if msg == "stop":
                return
            conn.send({"ms": samples, "taken": taken})
            samples, taken = [], 0
        now = time.monotonic()
        if now - beat > 1.0:  # a live status key: the workers' reaper leaves the probe's jobs alone
            r.hset(worker_key(PROBE_WORKER), mapping={"probe": "1"})
            r.expire(worker_key(PROBE_WORKER), 10)
            beat = now
        t0 = time.perf_counter()
        got = claimer.claim(1)
        samples.append((time.perf_counter() - t0) * 1000)
        taken += len(got)
        if len(samples) % 100 == 0:  # the claimed ids go back in line: the depth holds however long
            # the run (a slow start-up would otherwise empty a short queue before the load is timed)
            held = r.lrange(inflight_key(PROBE_WORKER), 0, -1)
            with r.pipeline() as pipe:
                if held:
                    pipe.rpush(queue_key(f"{PROBE_POOL}:default"), *held)
                pipe.delete(inflight_key(PROBE_WORKER))
                pipe.execute()
        time.sleep(every)


class Probe:
    def __init__(self, url: str, every: float) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=probe_main, args=(url, every, child), daemon=True)
        self.process.start()

    @property
    def pid(self) -> int:
        return self.process.pid or 0

    def take(self) -> dict[str, Any]:
        """The claim times since the last take (ms) and the jobs they took."""
        self.conn.send("take")
        return self.conn.recv()

    def stop(self) -> None:
        if self.process.is_alive():
            self.conn.send("stop")
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()


def fill_probe_queue(r: Any, depth: int) -> None:
    key = queue_key(f"{PROBE_POOL}:default")
    r.delete(key)
    for start in range(0, depth, 10_000):
        r.rpush(key, *(f"probe-{i}" for i in range(start, min(depth, start + 10_000))))


# -- load -----------------------------------------------------------------------------------------

@dataclass
class Sample:
    ttft: float | None
    e2e: float
    tokens: int
    gaps: list[float] = field(default_factory=list)
    error: str | None = None


def prompt_for(i: int) -> str:
    return " ".join(f"w{i}x{k}" for k in range(PROMPT_WORDS))


class HttpUser:
    """One kept-alive HTTP/1.1 connection to a gateway that POSTs the same streamed
    /v1/completions body again and again and reads the chunked SSE answer with as little parsing
    as a load generator can (httpx's async client costs ~3x the gateway's CPU per token)."""

    def __init__(self, url: str, prompt: str, max_tokens: int) -> None:
        self.host, _, port = url.removeprefix("http://").partition(":")
        self.port = int(port)
        body = json.dumps({"model": POOL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "stream": True, "stream_options": {"include_usage": True}}).encode()
        self.request = (f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\n"
                        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                        ).encode() + body
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None

    async def send(self) -> Sample:
        t0 = time.perf_counter()
        try:
            return await self._send(t0)
        except (OSError, asyncio.IncompleteReadError, ValueError) as e:
            await self.close()
            return Sample(None, time.perf_counter() - t0, 0, error=f"{type(e).__name__}: {e}")

    async def _send(self, t0: float) -> Sample:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        reader, writer = self.reader, self.writer
        assert reader is not None
        writer.write(self.request)
        head = await reader.readuntil(b"\r\n\r\n")
        status = head.split(b" ", 2)[1]
        if status != b"200" or b"chunked" not in head.lower():
            await self.close()
            return Sample(None, time.perf_counter() - t0, 0, error=f"HTTP {status.decode()}: {head[:200]!r}")
        ttft: float | None = None
        gaps: list[float] = []
        last, tokens = 0.0, 0
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            now = time.perf_counter()
            for event in chunk.split(b"\n\n"):
                if not event.startswith(b"data: {"):
                    continue
                if b'"completion_tokens"' in event:
                    tokens = int(json.loads(event[6:])["usage"]["completion_tokens"])
                elif b'"text":""' not in event:
                    if ttft is None:
                        ttft = now - t0
                    else:
                        gaps.append(now - last)
                    last = now
        return Sample(ttft, time.perf_counter() - t0, tokens, gaps, None if tokens else "no usage")


async def api_request(fleet: AsyncFleet, prompt: str, max_tokens: int) -> Sample:
    t0 = time.perf_counter()
    ttft: float | None = None
    gaps: list[float] = []
    last = t0
    job = await fleet.submit(prompt=prompt, max_tokens=max_tokens, temperature=0.0)
    async for ev in job.events(timeout=300):
        now = time.perf_counter()
        if ev.kind == "text" and ev.text:
            if ttft is None:
                ttft = now - t0
            else:
                gaps.append(now - last)
            last = now
        elif ev.kind == "done":
            tokens = int((ev.data or {}).get("usage", {}).get("completion_tokens", 0))
            return Sample(ttft, time.perf_counter() - t0, tokens, gaps)
        elif ev.kind == "error":
            return Sample(ttft, time.perf_counter() - t0, 0, gaps, str((ev.data or {}).get("error")))
    return Sample(ttft, time.perf_counter() - t0, 0, gaps, "no ending")


async def run_load(via: str, redis_url: str, gateways: list[GatewayProcess], users: int, jobs: int,
                   max_tokens: int, progress: Progress, task: Any) -> list[Sample]:
    """`users` closed-loop users, each with its own prompt (and connection), until `jobs` ended."""
    left = jobs
    samples: list[Sample] = []
    fleet = AsyncFleet(redis_url, pool=POOL, max_connections=64) if via == "api" else None
    http = [HttpUser(gateways[u % len(gateways)].url, prompt_for(u), max_tokens)
            for u in range(users)] if via == "http" else []

    async def user(u: int) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            if fleet is not None:
                s = await api_request(fleet, prompt_for(u), max_tokens)
            else:
                s = await http[u].send()
            samples.append(s)
            progress.advance(task)

    try:
        await asyncio.gather(*(user(u) for u in range(users)))
    finally:
        for h in http:
            await h.close()
        if fleet is not None:
            await fleet.aclose()
    return samples


# -- one level ------------------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 2)


def mean_ms(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    n = after[0] - before[0]
    return round((after[1] - before[1]) / n * 1000, 1) if n > 0 else None


def command_deltas(a: Snapshot, b: Snapshot, tokens: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for cmd, after in b.commands.items():
        before = a.commands.get(cmd, {"calls": 0.0, "usec": 0.0})
        calls, usec = after["calls"] - before["calls"], after["usec"] - before["usec"]
        if calls > 0:
            out[cmd.removeprefix("cmdstat_")] = {
                "calls": int(calls), "usec": round(usec), "usec_per_call": round(usec / calls, 2),
                "calls_per_1k_tokens": round(calls / tokens * 1000, 1) if tokens else None}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["usec"]))


@dataclass
class Fleet:
    args: argparse.Namespace
    redis: RedisServer
    r: Any
    config: Path
    logs: Path
    probe: Probe
    gateways: list[GatewayProcess] = field(default_factory=list)
    workers: list[WorkerProcess] = field(default_factory=list)
    idle0_rate: float = 0.0  # Redis CPU s per s with no worker (gateways idle + probe)

    def snap(self) -> Snapshot:
        return snapshot(self.r, self.gateways, self.workers, self.probe.pid)

    def grow(self, n: int) -> None:
        new = [start_worker(self.redis.url, f"cap-{i}", self.logs, wait=False, config=self.config)
               for i in range(len(self.workers), n)]
        for w in new:
            def up(w: WorkerProcess = w) -> bool:
                if not w.alive():
                    raise RuntimeError(f"worker {w.name} exited:\n{w.output()[-2000:]}")
                return bool(self.r.exists(worker_key(w.name)))
            wait_for(up, 120, f"worker {w.name} to register")
        self.workers += new

    def idle(self, seconds: float) -> dict[str, Any]:
        self.probe.take()
        a = self.snap()
        time.sleep(seconds)
        b = self.snap()
        claims = self.probe.take()["ms"]
        rate = (b.redis - a.redis) / (b.wall - a.wall)
        return {"seconds": round(b.wall - a.wall, 2), "redis_cpu_per_s": round(rate, 5),
                "claim_p50_ms": round(pct(claims, 0.5) or 0, 3),
                "claim_p99_ms": round(pct(claims, 0.99) or 0, 3),
                "claims": len(claims)}

    def load(self, jobs: int, max_tokens: int, progress: Progress, label: str) -> dict[str, Any]:
        args = self.args
        slots = len(self.workers) * args.slots
        users = max(slots, round(slots * args.oversubscribe))
        task = progress.add_task(label, total=jobs)
        self.probe.take()
        a = self.snap()
        samples = asyncio.run(run_load(args.via, self.redis.url, self.gateways, users, jobs, max_tokens,
                                       progress, task))
        b = self.snap()
        claims = self.probe.take()
        wall = b.wall - a.wall
        errors = [s.error for s in samples if s.error]
        tokens = sum(s.tokens for s in samples)
        done = len(samples) - len(errors)
        redis_gross = b.redis - a.redis
        redis_fleet = redis_gross - self.idle0_rate * wall
        gaps = [g for s in samples for g in s.gaps]
        ttfts = [s.ttft for s in samples if s.ttft is not None]
        streams = [(s.tokens - 1) / (s.e2e - s.ttft) for s in samples
                   if s.ttft is not None and s.tokens > 1 and s.e2e > s.ttft]
        ours = ((b.redis - a.redis) + (b.gateways - a.gateways) + (b.workers - a.workers) + (b.me - a.me)
                + (b.probe - a.probe))
        busy = b.busy - a.busy
        k = 1000 / tokens if tokens else 0.0
        return {
            "workers": len(self.workers), "slots": slots, "users": users, "jobs": len(samples),
            "jobs_ok": done, "errors": len(errors), "error_examples": errors[:3], "max_tokens": max_tokens,
            "tokens": tokens, "wall_s": round(wall, 2), "tok_per_s": round(tokens / wall, 1),
            "tok_per_s_per_stream_p50": round(statistics.median(streams), 2) if streams else None,
            "redis_cpu_s": round(redis_gross, 4), "redis_cpu_fleet_s": round(redis_fleet, 4),
            "gateway_cpu_s": round(b.gateways - a.gateways, 3) if self.gateways else None,
            "worker_cpu_s": round(b.workers - a.workers, 3),
            "redis_core_busy_pct": round(100 * redis_gross / wall, 1),
            "redis_ms_per_1k_tokens": round(redis_fleet * 1000 * k, 3),
            "redis_ms_per_job": round(redis_fleet * 1000 / done, 3) if done else None,
            "gateway_ms_per_1k_tokens": (round((b.gateways - a.gateways) * 1000 * k, 1)
                                         if self.gateways else None),
            "worker_ms_per_1k_tokens": round((b.workers - a.workers) * 1000 * k, 1),
            "loadgen_ms_per_1k_tokens": round((b.me - a.me) * 1000 * k, 1),
            "machine_busy_pct": round(100 * busy / (b.total - a.total), 1),
            "others_cpu_s": round(max(0.0, busy - ours), 2),
            "claim_at_depth_p50_ms": round(pct(claims["ms"], 0.5) or 0, 3),
            "claim_at_depth_p99_ms": round(pct(claims["ms"], 0.99) or 0, 3),
            "claims_timed": len(claims["ms"]), "claims_took": claims["taken"],
            "ttft_p50_ms": ms(pct(ttfts, 0.5)), "ttft_p99_ms": ms(pct(ttfts, 0.99)),
            "gap_p50_ms": ms(pct(gaps, 0.5)), "gap_p99_ms": ms(pct(gaps, 0.99)),
            # the workers' own histograms (observe): enqueue -> claim (Redis time), and their TTFT
            **{f"worker_{m}_mean_ms": mean_ms(a.hists[m], b.hists[m]) for m in ("queue_wait", "ttft")},
            "commands": command_deltas(a, b, tokens),
        }


# -- derived --------------------------------------------------------------------------------------

def derive(row: dict[str, Any], idle_per_worker: float, args: argparse.Namespace) -> dict[str, Any]:
    """Workers one Redis core carries at the nominal rate, from the level's measured CPU per token
    (which already holds the per-job share at this job length) plus a worker's idle cost."""
    per_token = row["redis_ms_per_1k_tokens"] / 1e6  # s of Redis CPU per token
    per_worker_s = per_token * args.slots * args.rate + idle_per_worker
    gateway = row.get("gateway_ms_per_1k_tokens")
    out = {"redis_cpu_per_worker_s": round(per_worker_s, 5),
           "workers_per_redis_core": round(1 / per_worker_s, 1) if per_worker_s > 0 else None,
           "streams_per_redis_core": round(args.slots / per_worker_s) if per_worker_s > 0 else None}
    if gateway:
        per_stream = gateway / 1e6 * args.rate  # gateway CPU s per stream-second
        out["streams_per_gateway_core"] = round(1 / per_stream)
    return out


def fit_per_job(long: dict[str, Any], short: dict[str, Any]) -> dict[str, float] | None:
    """CPU = a x jobs + b x tokens through the two runs (exact for two points), for Redis, the
    gateway(s) and the workers."""
    j1, t1, j2, t2 = long["jobs_ok"], long["tokens"], short["jobs_ok"], short["tokens"]
    det = j1 * t2 - j2 * t1
    if not det:
        return None
    out = {}
    for who in ("redis", "gateway", "worker"):
        key = "redis_cpu_fleet_s" if who == "redis" else f"{who}_cpu_s"
        c1, c2 = long.get(key), short.get(key)
        if c1 is None or c2 is None:
            continue
        out[f"{who}_ms_per_job"] = round((c1 * t2 - c2 * t1) / det * 1000, 3)
        out[f"{who}_ms_per_1k_tokens"] = round((j1 * c2 - j2 * c1) / det * 1e6, 3)
    return out


def claim_bench(depth: int, claims: int, console: Console) -> dict[str, Any] | None:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    console.log(f"scripts/bench_claim.py --queued {depth} --claims {claims} (a quiet private Redis)")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_claim.py"), "--queued", str(depth),
                           "--claims", str(claims), "--out", str(out)], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        console.log(f"[red]bench_claim failed[/]: {proc.stderr[-1000:]}")
        return None
    report = json.loads(out.read_text())
    out.unlink()
    return {"command": f"scripts/bench_claim.py --queued {depth} --claims {claims}", "cases": report["cases"]}


# -- main -----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="1,2,4,8", help="worker counts, ascending (default 1,2,4,8)")
    p.add_argument("--slots", type=int, default=16, help="slots per worker (default 16)")
    p.add_argument("--rate", type=float, default=25.0,
                   help="tok/s per stream: step_delay = 1/rate (default 25)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3,
                   help="jobs per level = rounds x workers x slots (default 3)")
    p.add_argument("--oversubscribe", type=float, default=1.0,
                   help="open streams per slot (default 1: every slot busy, nothing queued, so TTFT "
                   "is the job path's; above 1 TTFT includes queueing)")
    p.add_argument("--via", choices=("http", "api"), default="http",
                   help="http: /v1/completions through `fleet serve`; api: AsyncFleet in this process")
    p.add_argument("--gateways", type=int, default=1, help="`fleet serve` processes (http; default 1)")
    p.add_argument("--idle", type=float, default=3.0, help="idle seconds measured before each level")
    p.add_argument("--depth", type=int, default=100_000, help="job ids queued for the claim probe")
    p.add_argument("--probe-every", type=float, default=0.02, help="seconds between probe claims")
    p.add_argument("--short-tokens", type=int, default=0,
                   help="also run one level with jobs this long (per-job vs per-token CPU)")
    p.add_argument("--short-at", type=int, default=2, help="the level --short-tokens repeats (default 2)")
    p.add_argument("--stream-interval", type=float, default=None,
                   help="the workers' stream_interval (default: the setting's default, 0.03 s)")
    p.add_argument("--no-aof", action="store_true", help="Redis without AOF (default: appendonly everysec)")
    p.add_argument("--claim-bench", action="store_true",
                   help="also run scripts/bench_claim.py --queued DEPTH")
    p.add_argument("--claim-bench-claims", type=int, default=2000)
    p.add_argument("--out", default="bench-redis-capacity.json")
    args = p.parse_args(argv)
    args.levels = [int(x) for x in args.workers.split(",")]
    if args.levels != sorted(args.levels) or args.levels[0] < 1:
        p.error("--workers must be ascending counts >= 1")
    if args.short_tokens and args.short_at not in args.levels:
        p.error("--short-at must be one of --workers")
    if args.max_tokens > PROMPT_WORDS or args.short_tokens > PROMPT_WORDS:
        p.error(f"at most {PROMPT_WORDS} tokens per job")
    return args


def print_tables(console: Console, report: dict[str, Any]) -> None:
    args = report["args"]
    t = Table(title=f"One redis-server, fake workers ({args['slots']} slots, ~{args['rate']:g} tok/s per "
              f"stream), {args['max_tokens']}-token jobs via {args['via']}; measured (CPU time)")
    cols = ("workers", "streams", "jobs", "tok/s", "tok/s/stream", "Redis core %", "Redis ms/1k tok",
            "Redis ms/job", "gateway ms/1k tok", "worker ms/1k tok", "claim@depth p50/p99 ms",
            "TTFT p99 ms", "gap p99 ms", "box busy %", "errors")
    for c in cols:
        t.add_column(c, justify="right")
    rows = report["levels"] + ([report["short"]] if report.get("short") else [])
    for row in rows:
        name = str(row["workers"])
        if row["max_tokens"] != args["max_tokens"]:
            name += f" ({row['max_tokens']} tok)"
        gateway = row["gateway_ms_per_1k_tokens"]
        t.add_row(name, str(row["slots"]), str(row["jobs"]), f"{row['tok_per_s']:.0f}",
                  f"{row['tok_per_s_per_stream_p50'] or 0:.1f}", f"{row['redis_core_busy_pct']:.1f}",
                  f"{row['redis_ms_per_1k_tokens']:.1f}", f"{row['redis_ms_per_job'] or 0:.2f}",
                  "-" if gateway is None else f"{gateway:.0f}",
                  f"{row['worker_ms_per_1k_tokens']:.0f}",
                  f"{row['claim_at_depth_p50_ms']:.2f} / {row['claim_at_depth_p99_ms']:.2f}",
                  f"{row['ttft_p99_ms'] or 0:.0f}", f"{row['gap_p99_ms'] or 0:.0f}",
                  f"{row['machine_busy_pct']:.0f}", str(row["errors"]))
    console.print(t)
    d = Table(title="Derived (from the measured CPU per token; --rate tok/s per stream, nominal)")
    for c in ("workers", "Redis CPU s per worker-s", "workers per Redis core", "streams per Redis core",
              "streams per gateway core"):
        d.add_column(c, justify="right")
    for row in report["levels"]:
        x = row["derived"]
        d.add_row(str(row["workers"]), f"{x['redis_cpu_per_worker_s']:.4f}", f"{x['workers_per_redis_core']}",
                  f"{x['streams_per_redis_core']}", str(x.get("streams_per_gateway_core", "-")))
    console.print(d)
    if report.get("fit"):
        console.print(f"per job / per token (two job lengths, {report['short']['workers']} workers): "
                      f"{report['fit']}")
    console.print(f"idle: Redis CPU per s with no worker {report['idle0']['redis_cpu_per_s'] * 1000:.2f} ms; "
                  f"per idle worker {report['idle_per_worker_ms_per_s']:.2f} ms/s")
    if report.get("claim_bench"):
        cases = report["claim_bench"]["cases"]
        console.print(f"{report['claim_bench']['command']}: " + "; ".join(
            f"{k} p50 {v['median_us']:.0f} µs p99 {v['p99_us']:.0f} µs" for k, v in cases.items()))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    console = Console(width=max(150, Console().width))
    started = time.monotonic()
    report: dict[str, Any] = {"machine": machine_meta(), "args": {k: v for k, v in vars(args).items()},
                              "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
                              "levels": []}
    report["machine"]["redis"] = subprocess.run(["redis-server", "--version"], capture_output=True, text=True,
                                                check=False).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="bench-redis-capacity-") as tmp_name:
        tmp = Path(tmp_name)
        config = tmp / "fleet.json"
        worker_config: dict[str, Any] = {"pool": POOL, "backend": {
            "type": "fake", "slots": args.slots, "step_delay": round(1 / args.rate, 4)}}
        if args.stream_interval is not None:
            worker_config["stream_interval"] = args.stream_interval
        config.write_text(json.dumps(worker_config))
        extra = [] if args.no_aof else ["--appendonly", "yes", "--appendfsync", "everysec"]
        with RedisServer.start(tmp / "redis", extra=extra) as redis:
            r = redis.client()
            fill_probe_queue(r, args.depth)
            probe = Probe(redis.url, args.probe_every)
            fleet = Fleet(args, redis, r, config, tmp / "logs", probe)
            try:
                if args.via == "http":
                    fleet.gateways = [start_gateway(redis.url, tmp / "logs", name=f"gateway-{i}",
                                                    config=config) for i in range(args.gateways)]
                console.log(f"redis-server :{redis.port}, {len(fleet.gateways)} gateway(s), probe at depth "
                            f"{args.depth:,}; measuring idle Redis with no worker")
                time.sleep(1)
                report["idle0"] = fleet.idle(args.idle)
                fleet.idle0_rate = report["idle0"]["redis_cpu_per_s"]
                columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TimeElapsedColumn())
                idle_costs = []
                with Progress(*columns, console=console) as progress:
                    for n in args.levels:
                        fleet.grow(n)
                        time.sleep(1)
                        idle = fleet.idle(args.idle)
                        per_worker = max(0.0, idle["redis_cpu_per_s"] - fleet.idle0_rate) / n
                        idle_costs.append(per_worker)
                        jobs = args.rounds * n * args.slots
                        row = fleet.load(jobs, args.max_tokens, progress, f"{n} worker(s), {jobs} jobs")
                        row["idle"] = idle
                        row["idle_per_worker_ms_per_s"] = round(per_worker * 1000, 3)
                        row["derived"] = derive(row, per_worker, args)
                        report["levels"].append(row)
                        progress.console.log(
                            f"W={n}: {row['tok_per_s']:.0f} tok/s, Redis {row['redis_core_busy_pct']:.1f} % "
                            f"of a core, {row['redis_ms_per_1k_tokens']:.1f} ms/1k tok, claim p99 "
                            f"{row['claim_at_depth_p99_ms']:.2f} ms, {row['errors']} errors")
                        if args.short_tokens and n == args.short_at:
                            jobs *= max(1, args.max_tokens // args.short_tokens) // 2
                            short = fleet.load(jobs, args.short_tokens, progress,
                                               f"{n} worker(s), {jobs} jobs of {args.short_tokens} tokens")
                            report["short"] = short
                            report["fit"] = fit_per_job(row, short)
                report["idle_per_worker_ms_per_s"] = round(statistics.median(idle_costs) * 1000, 3)
                report["aof_rewrites"] = int(r.info("persistence").get("aof_rewrites", 0))
                report["redis_used_memory_mb"] = round(r.info("memory")["used_memory"] / 2**20, 1)
            finally:
                probe.stop()
                for w in fleet.workers:
                    w.stop(timeout=60)
                for g in fleet.gateways:
                    g.stop()
    if args.claim_bench:
        report["claim_bench"] = claim_bench(args.depth, args.claim_bench_claims, console)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    print_tables(console, report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    console.log(f"wrote {args.out} ({report['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main()
