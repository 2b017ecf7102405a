"""Fair share in tokens, measured: one real `fleet worker` on the embedded model, two tenants both
backlogged on it, tenant A sending ~3,000-token documents and tenant B ~100-token questions (both
`max_tokens` 64), each from closed-loop users (more than the worker's slots, so each always has
jobs waiting), for `--seconds`. Then B alone, for B's TTFT without A. Prints a table and writes
JSON.

    .venv/bin/python scripts/bench_tenant_tokens.py --seconds 120 --out tenant-tokens.json

Tokens served are the usage of the jobs that ended within the window (prompt + generated; the
fair share's own unit, weighted, beside: backends/contract/queue/fair.py). A's prompt length is
calibrated on the model's tokenizer first (one job). TTFT is submit -> first text delta, as B's
users see it, queueing included.
"""

from __future__ import annotations

import json
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.contract.gateway_settings import FairTokens  # noqa: E402
from backends.contract.queue.fair import served  # noqa: E402
from dispatcher import Fleet  # noqa: E402
from ecosystem.local.bench import machine_meta  # noqa: E402
from ecosystem.local.processes import RedisServer, start_worker  # noqa: E402
from scripts.bench_tenants import percentile  # noqa: E402

WORDS = ["river", "stone", "apple", "cloud", "winter", "market", "garden", "letter", "silver", "engine",
         "window", "forest", "copper", "harbor", "candle", "meadow", "bridge", "lantern", "orchard",
         "thunder"]


def text(rng: random.Random, chars: int) -> str:
    """Prose-like filler of about `chars` characters, its start unique (no cached prefix)."""
    words = [f"Document {rng.getrandbits(48):x}."]
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)


@dataclass
class Ended:
    tenant: str
    ended: float  # monotonic
    ttft_ms: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class Users:
    """Closed-loop users: each submits its next request as its last one ends, until `until`
    (monotonic); what ended in time goes to `ended`, what runs past it is cancelled (`stop`)."""

    def __init__(self, fleet: Fleet, until: float) -> None:
        self.fleet, self.until = fleet, until
        self.ended: list[Ended] = []
        self.running: set[str] = set()
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def add(self, tenant: str, n: int, chars: int, max_tokens: int) -> None:
        self.threads += [threading.Thread(target=self._user, args=(tenant, u, chars, max_tokens), daemon=True)
                         for u in range(n)]

    def run(self) -> list[Ended]:
        for t in self.threads:
            t.start()
        time.sleep(max(0.0, self.until - time.monotonic()))
        with self.lock:
            late = list(self.running)
        for job_id in late:  # the window closed: what still runs is not counted, and stops
            self.fleet.job(job_id).cancel()
        for t in self.threads:
            t.join(timeout=120)
        return self.ended

    def _user(self, tenant: str, u: int, chars: int, max_tokens: int) -> None:
        rng = random.Random(f"{tenant}{u}")
        while time.monotonic() < self.until:
            started = time.monotonic()
            job = self.fleet.submit(prompt=text(rng, chars), max_tokens=max_tokens, tenant=tenant)
            with self.lock:
                self.running.add(job.id)
            first = None
            try:
                for _delta in job.stream(timeout=self.until - started + 120):
                    if first is None:
                        first = time.monotonic() - started
                ended = time.monotonic()
                result = job.result(timeout=30)
            except Exception:  # cancelled at the window's end (or failed): not served in it
                continue
            finally:
                with self.lock:
                    self.running.discard(job.id)
            usage = result["usage"]
            if result.get("finish_reason") == "cancelled" or ended > self.until:
                continue
            ttft = (first if first is not None else ended - started) * 1000
            done = Ended(tenant, ended, ttft, int(usage.get("prompt_tokens") or 0),
                         int(usage.get("cached_tokens") or 0), int(usage.get("completion_tokens") or 0))
            with self.lock:
                self.ended.append(done)


def calibrate(fleet: Fleet, tokens: int) -> int:
    """Characters of `text` that the model reads as about `tokens` tokens."""
    probe = 4 * tokens
    used = fleet.submit(prompt=text(random.Random(0), probe), max_tokens=1).result(timeout=300)["usage"]
    return max(16, round(probe * tokens / max(1, int(used["prompt_tokens"]))))


def scenario(name: str, weights: dict[str, float], plan: dict[str, int], args: dict[str, Any],
             logs: Path) -> dict[str, Any]:
    """`plan`: tenant -> characters of its prompts; returns the row of each tenant."""
    with tempfile.TemporaryDirectory() as tmp, RedisServer.start(Path(tmp)) as redis:
        worker = start_worker(redis.url, "bench-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", name), logs,
                              backend__slots=args["slots"],
                              gateway__tenants={t: {"weight": weights.get(t, 1.0)} for t in plan})
        try:
            fleet = Fleet(redis.url)
            fleet.submit(prompt="warm up", max_tokens=4).result(timeout=300)
            users = Users(fleet, time.monotonic() + args["seconds"])
            for tenant, chars in plan.items():
                users.add(tenant, args["users"], chars, args["max_tokens"])
            ended = users.run()
        finally:
            worker.stop()
    weights_of = FairTokens()
    rows = []
    for tenant in plan:
        mine = [e for e in ended if e.tenant == tenant]
        ttfts = [e.ttft_ms for e in mine]
        rows.append({
            "scenario": name, "tenant": tenant, "weight": weights.get(tenant, 1.0), "jobs": len(mine),
            "prompt_tokens": sum(e.prompt_tokens for e in mine),
            "cached_tokens": sum(e.cached_tokens for e in mine),
            "completion_tokens": sum(e.completion_tokens for e in mine),
            "tokens": sum(e.prompt_tokens + e.completion_tokens for e in mine),
            "weighted": round(sum(served(asdict(e), weights_of) for e in mine), 1),
            "ttft_p50_ms": round(statistics.median(ttfts), 1) if ttfts else None,
            "ttft_p95_ms": round(percentile(ttfts, 0.95), 1) if ttfts else None,
            "seconds": args["seconds"]})
    for key in ("tokens", "weighted"):
        total = sum(r[key] for r in rows) or 1
        for r in rows:
            r[f"{key}_share"] = round(r[key] / total, 3)
    return {"scenario": name, "rows": rows}


@click.command()
@click.option("--seconds", default=120.0, show_default=True, help="each contended scenario's window")
@click.option("--alone-seconds", default=60.0, show_default=True, help="B alone's window (0: skip)")
@click.option("--slots", default=4, show_default=True, help="the worker's slots")
@click.option("--users", default=8, show_default=True, help="closed-loop users per tenant")
@click.option("--a-tokens", default=3000, show_default=True, help="tokens of A's prompts")
@click.option("--b-tokens", default=100, show_default=True, help="tokens of B's prompts")
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--weighted/--no-weighted", default=True, show_default=True,
              help="also run A at weight 3 (expect A 3:1 B)")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("bench-tenant-tokens.json"))
def main(seconds: float, alone_seconds: float, slots: int, users: int, a_tokens: int, b_tokens: int,
         max_tokens: int, weighted: bool, out: Path) -> None:
    console = Console()
    logs = Path(tempfile.mkdtemp(prefix="bench-tenant-tokens-"))
    with tempfile.TemporaryDirectory() as tmp, RedisServer.start(Path(tmp)) as redis:
        worker = start_worker(redis.url, "bench-calibrate", logs, backend__slots=slots)
        try:
            fleet = Fleet(redis.url)
            chars = {"a": calibrate(fleet, a_tokens), "b": calibrate(fleet, b_tokens)}
        finally:
            worker.stop()
    console.log(f"prompt characters for {a_tokens} / {b_tokens} tokens: {chars}")
    args = {"seconds": seconds, "slots": slots, "users": users, "max_tokens": max_tokens}
    plan: list[tuple[str, dict[str, float], dict[str, int], float]] = [("A and B, 1:1", {}, chars, seconds)]
    if weighted:
        plan.append(("A and B, A weight 3", {"a": 3.0}, chars, seconds))
    if alone_seconds:
        plan.append(("B alone", {}, {"b": chars["b"]}, alone_seconds))
    results = []
    for name, weights, tenants, window in plan:
        console.log(f"[bold]{name}[/]: {window:.0f} s, {users} users each, {slots} slots")
        results.append(scenario(name, weights, tenants, args | {"seconds": window}, logs))
        console.log(results[-1])
    alone = next((r["rows"][0]["ttft_p95_ms"] for r in results if r["scenario"] == "B alone"), None)
    table = Table(title=f"tokens served per tenant: A {a_tokens}-token prompts, B {b_tokens}, "
                        f"max_tokens {max_tokens}, {slots} slots")
    for col in ("scenario", "tenant", "weight", "jobs", "prompt tok", "generated tok", "tokens", "share",
                "weighted share", "TTFT p50 ms", "TTFT p95 ms", "p95 / B alone"):
        table.add_column(col, justify="left" if col in ("scenario", "tenant") else "right")
    for result in results:
        for r in result["rows"]:
            b_p95 = r["ttft_p95_ms"] if r["tenant"] == "b" else None
            ratio = b_p95 / alone if alone and b_p95 else None
            r["ttft_p95_vs_b_alone"] = round(ratio, 2) if ratio else None
            table.add_row(r["scenario"], r["tenant"], f"{r['weight']:g}", str(r["jobs"]),
                          f"{r['prompt_tokens']:,}", f"{r['completion_tokens']:,}", f"{r['tokens']:,}",
                          f"{r['tokens_share']:.1%}",
                          f"{r['weighted_share']:.1%}", f"{r['ttft_p50_ms'] or 0:.0f}",
                          f"{r['ttft_p95_ms'] or 0:.0f}", f"{ratio:.2f}x" if ratio else "-")
    console.print(table)
    out.write_text(json.dumps({"machine": machine_meta(), "prompt_chars": chars, "settings": args,
                               "fair_tokens": FairTokens().model_dump(), "results": results}, indent=1))
    console.print(f"JSON: {out}")


if __name__ == "__main__":
    main()
