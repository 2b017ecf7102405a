"""`fleet bench --workload stalls`: do running streams freeze while someone's long prompt prefills?

U users stream a long answer each (OpenAI's `/v1/completions`, streamed, `ignore_eos`); once every
stream has its first token, two long prompts (3,000 tokens by default, new text each round) arrive
`--long-gap` seconds apart. Measured client-side, per round and system:

- the longest gap between two chunks of any running stream while the long prompts are prefilled
  (from the first one's POST to the last one's first token), and every such gap (for the p99);
- each long prompt's TTFT.

Three systems, same run, order flipped every round (ABBA): `fleet serve` with its defaults
(`max_stall_ms`), the same fleet prefilling whole `n_batch` chunks beside the streams
(`max_stall_ms=0`: what the setting changes), and llama-server (its defaults, `-np` = U + the long
prompts).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import connect_sse
from rich.console import Console
from rich.table import Table

from backends.model import default_model_path
from ecosystem.local.bench_load import POOL, http_client, llama_server_extra
from ecosystem.local.bench_report import percentile
from ecosystem.local.bench_setup import machine_meta, start_fleet_workers, workdir
from ecosystem.local.bench_text import paragraph
from ecosystem.local.bench_workloads import Tokenizer, fit
from ecosystem.local.llama_server import llama_server_binary, start_llama_server
from ecosystem.local.processes import RedisServer, start_gateway, wait_until_healthy

FLEET, WHOLE, PEER = "fleet serve", "fleet serve, whole chunks", "llama-server"
STREAM_PROMPT = "Count from 1 to 1000, one number a line:"
LONG_MAX_TOKENS = 16
PER_SLOT = 4096


@dataclass(frozen=True)
class StallsConfig:
    users: int = 4
    stream_tokens: int = 400
    long_tokens: int = 3000
    long_prompts: int = 2
    long_gap: float = 0.5
    rounds: int = 4
    threads: int = 2
    seed: int = 0
    fleet_settings: tuple[str, ...] = ()


@dataclass
class StallsRun:
    system: str
    round: int
    max_gap_ms: float = 0.0
    gaps_ms: list[float] = field(default_factory=list)  # every running stream's gaps in the window
    long_ttft_ms: list[float] = field(default_factory=list)
    covered: bool = True  # every stream ran through the whole window
    errors: list[str] = field(default_factory=list)


def _chunks(client: httpx.Client, body: dict[str, Any], times: list[float], errors: list[str]) -> None:
    """Stream one completion, appending each text chunk's arrival time."""
    try:
        with connect_sse(client, "POST", "/v1/completions", json=body) as source:
            if source.response.status_code != 200:
                source.response.read()
                errors.append(f"HTTP {source.response.status_code}: {source.response.text[:200]}")
                return
            for sse in source.iter_sse():
                if sse.data == "[DONE]":
                    return
                chunk = json.loads(sse.data)
                if chunk.get("error"):
                    errors.append(json.dumps(chunk["error"])[:200])
                    return
                if any(c.get("text") for c in chunk.get("choices") or []):
                    times.append(time.perf_counter())
    except httpx.HTTPError as e:
        errors.append(f"{type(e).__name__}: {e}")


class StallsBench:
    def __init__(self, cfg: StallsConfig, console: Console, workdir: Path) -> None:
        self.cfg, self.console, self.logs = cfg, console, workdir / "logs"
        self.workdir = workdir
        self.tok = Tokenizer(default_model_path())
        self.slots = cfg.users + cfg.long_prompts

    def _fleet(self, stack: contextlib.ExitStack, tag: str, settings: dict[str, Any]) -> str:
        redis = stack.enter_context(RedisServer.start(self.workdir / f"redis-{tag}"))
        backend = {"type": "llama-cpp", "slots": self.slots, "n_ctx_per_seq": PER_SLOT,
                   **dict(kv.split("=", 1) for kv in self.cfg.fleet_settings), **settings}
        for w in start_fleet_workers(redis.url, f"bench-{tag}", self.logs, workers=1,
                                     threads=self.cfg.threads, worker_settings={}, backend=backend):
            stack.callback(w.stop)
        gw = start_gateway(redis.url, self.logs, name=f"gateway-{tag}")
        stack.callback(gw.stop)
        wait_until_healthy(gw, 60)
        return gw.url

    def _long_prompts(self, round_: int) -> list[str]:
        rng = random.Random(f"{self.cfg.seed}-{round_}")
        target = self.cfg.long_tokens
        return [fit(self.tok, f"Document {round_}.{i}:\n", "\nSummarise the document in one line.", target,
                    lambda: paragraph(rng), (target - 8, target + 8)) for i in range(self.cfg.long_prompts)]

    def measure(self, system: str, url: str, round_: int, longs: list[str]) -> StallsRun:
        cfg = self.cfg
        extra = llama_server_extra() if system == PEER else {}
        run = StallsRun(system, round_)
        streams: list[list[float]] = [[] for _ in range(cfg.users)]
        long_times: list[list[float]] = [[] for _ in longs]
        sent: list[float] = [0.0] * len(longs)
        with http_client(url, cfg.users + len(longs)) as client:
            def body(prompt: str, tokens: int) -> dict[str, Any]:
                return {"model": POOL, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
                        "ignore_eos": True, "stream": True, **extra}

            users = [threading.Thread(target=_chunks, args=(client, body(f"{STREAM_PROMPT} ({round_}.{u})",
                                                                           cfg.stream_tokens), streams[u],
                                                          run.errors)) for u in range(cfg.users)]
            for t in users:
                t.start()
            deadline = time.monotonic() + 120
            while not all(streams) and time.monotonic() < deadline and not run.errors:
                time.sleep(0.01)
            time.sleep(0.3)  # the streams are running, past their first tokens

            def long(i: int) -> None:
                sent[i] = time.perf_counter()
                _chunks(client, body(longs[i], LONG_MAX_TOKENS), long_times[i], run.errors)

            longers = []
            for i in range(len(longs)):
                longers.append(threading.Thread(target=long, args=(i,)))
                longers[-1].start()
                time.sleep(cfg.long_gap)
            for t in [*longers, *users]:
                t.join()
        if run.errors or not all(long_times):
            run.errors = run.errors or ["a long prompt gave no text"]
            return run
        start, end = sent[0], max(t[0] for t in long_times)
        run.long_ttft_ms = [(t[0] - s) * 1000 for t, s in zip(long_times, sent, strict=True)]
        for times in streams:
            run.covered &= bool(times) and times[-1] >= end
            run.gaps_ms += [(b - a) * 1000 for a, b in itertools.pairwise(times) if b > start and a < end]
        run.max_gap_ms = max(run.gaps_ms, default=0.0)
        return run

    def run(self) -> list[StallsRun]:
        cfg, runs = self.cfg, []
        with contextlib.ExitStack() as stack:
            self.console.log(f"starting two fleets ({self.slots} slots, n_ctx_per_seq {PER_SLOT}) and "
                             f"llama-server -np {self.slots}")
            urls = {FLEET: self._fleet(stack, "paced", {}),
                    WHOLE: self._fleet(stack, "whole", {"max_stall_ms": 0})}
            server = stack.enter_context(start_llama_server(self.logs, parallel=self.slots,
                                                            ctx=self.slots * PER_SLOT, threads=cfg.threads))
            urls[PEER] = server.url
            systems = [FLEET, WHOLE, PEER]
            for round_ in range(cfg.rounds):
                longs = self._long_prompts(round_)
                for system in systems if round_ % 2 == 0 else systems[::-1]:
                    run = self.measure(system, urls[system], round_, longs)
                    runs.append(run)
                    self.console.log(f"round {round_} {system}: longest gap {run.max_gap_ms:.0f} ms, long "
                                     f"TTFT {', '.join(f'{t:.0f}' for t in run.long_ttft_ms)} ms"
                                     + ("" if run.covered else " (a stream ended inside the window)")
                                     + (f", errors: {run.errors[:2]}" if run.errors else ""))
        return runs


def summarise(runs: list[StallsRun]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for system in (FLEET, WHOLE, PEER):
        mine = [r for r in runs if r.system == system and not r.errors]
        gaps = [g for r in mine for g in r.gaps_ms]
        ttft = [t for r in mine for t in r.long_ttft_ms]
        out[system] = {"rounds": len(mine), "max_gap_ms": max((r.max_gap_ms for r in mine), default=None),
                       "median_max_gap_ms": statistics.median([r.max_gap_ms for r in mine]) if mine else None,
                       "gap_p99_ms": percentile(gaps, 99), "gap_p50_ms": percentile(gaps, 50),
                       "long_ttft_p50_ms": percentile(ttft, 50), "long_ttft_max_ms": max(ttft, default=None),
                       "all_covered": all(r.covered for r in mine)}
    whole = [r for r in runs if r.system == WHOLE and not r.errors]
    paced = {r.round: r for r in runs if r.system == FLEET and not r.errors}
    ratios = [statistics.mean(paced[w.round].long_ttft_ms) / statistics.mean(w.long_ttft_ms)
              for w in whole if w.round in paced]
    out[FLEET]["long_ttft_vs_whole"] = statistics.median(ratios) if ratios else None
    return out


def run_stalls(cfg: StallsConfig, console: Console, out: Path, keep_logs: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {**machine_meta(), "config": asdict(cfg),
                            "llama_server": str(llama_server_binary())}
    with workdir(keep_logs) as tmp:
        console.log(f"logs in {tmp / 'logs'}")
        runs = StallsBench(cfg, console, tmp).run()
    meta["loadavg_after"] = os.getloadavg()
    summary = summarise(runs)
    table = Table(title=f"Stalls on {meta['cpu'] or 'an unnamed CPU'}: {cfg.users} streams, "
                        f"{cfg.long_prompts} prompts of {cfg.long_tokens} tokens {cfg.long_gap} s apart, "
                        f"{cfg.rounds} rounds")
    for col in ("system", "longest gap ms", "median of rounds' longest", "gap p99 ms", "gap p50 ms",
                "long TTFT p50 ms", "long TTFT vs whole chunks"):
        table.add_column(col, justify="right" if col != "system" else "left")
    for system, s in summary.items():
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:,.0f}"
        ratio = s.get("long_ttft_vs_whole")
        table.add_row(system, ms(s["max_gap_ms"]), ms(s["median_max_gap_ms"]), ms(s["gap_p99_ms"]),
                      ms(s["gap_p50_ms"]), ms(s["long_ttft_p50_ms"]),
                      "" if ratio is None else f"{ratio:.2f}x")
    console.print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs_json = [asdict(r) for r in runs]
    out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs_json}, indent=1))
    console.print(f"JSON: {out}")
    return summary
