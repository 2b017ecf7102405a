#!/usr/bin/env python3
"""KV layouts of the in-process engine side by side: CPU per token and memory.

Each layout runs in a fresh process (ggml fixes kernels per process; memory is the process's own):
it loads `LlamaCppBackend` with 16 slots and the layout's settings, runs greedy jobs at 1 user and
at 16 users (closed loop, `--tokens` each), and reports CPU seconds of the process per 1,000
generated tokens, tok/s, and USS (private memory) once loaded and after the run. Beside them,
`llama-server -np 16` with the same total context serves the same 16-user load, and its USS is
read the same way. Prints a table and writes JSON.

    .venv/bin/python scripts/bench_kv_layouts.py --out bench-kv-layouts.json
    .venv/bin/python scripts/bench_kv_layouts.py --layouts per-slot-1k,unified-16k --threads 1
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import click
import httpx
import psutil
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ecosystem.local.bench import machine_meta  # noqa: E402
from ecosystem.local.llama_server import start_llama_server  # noqa: E402

SLOTS = 16
MIB = 2**20
# name -> (backend settings, llama-server -c of the same total context)
LAYOUTS: dict[str, tuple[dict[str, Any], int]] = {
    "per-slot-1k": ({"kv_unified": False, "n_ctx_per_seq": 1024}, SLOTS * 1024),
    "per-slot-4k": ({"kv_unified": False, "n_ctx_per_seq": 4096}, SLOTS * 4096),
    "per-slot-1k-nodraft": ({"kv_unified": False, "n_ctx_per_seq": 1024, "draft_max": 0}, SLOTS * 1024),
    "unified-16k": ({"kv_unified": True, "n_ctx": 16384, "n_ctx_per_seq": 4096}, 16384),  # the default
    "unified-16k-nodraft": ({"kv_unified": True, "n_ctx": 16384, "n_ctx_per_seq": 4096, "draft_max": 0},
                            16384),
    "unified-32k": ({"kv_unified": True, "n_ctx": 32768, "n_ctx_per_seq": 8192}, 32768),
}
PROMPTS = [f"Write a short story about {t}." for t in (
    "a lighthouse", "bread", "the sky", "Rome", "a puppy", "rain", "computers", "chess",
    "the future", "football", "Mars", "bees", "volcanoes", "a detective", "the piano", "water")]

# Runs inside the fresh process: the engine on one layout, 1 user then 16 users.
PROBE = r"""
import json, sys, time, psutil
from backends.contract.schema import GenerateRequest
from backends.llamacpp import LlamaCppBackend
from backends.llamacpp_settings import LlamaCppSettings
from backends.base import Token
cfg = json.loads(sys.argv[1])
me = psutil.Process()
b = LlamaCppBackend(LlamaCppSettings(slots=cfg["slots"], prefix_cache=cfg["prefix_cache"], **cfg["layout"]),
                    threads=cfg["threads"])
out = {"uss_loaded_mib": me.memory_full_info().uss / 2**20}
def run(users, jobs):
    prompts, n, done, tokens = cfg["prompts"], 0, 0, 0
    def admit():
        nonlocal n
        b.admit(f"j{n}", GenerateRequest(prompt=prompts[n % len(prompts)], max_tokens=cfg["tokens"],
                                         temperature=0.0, stop=[]))
        n += 1
    for _ in range(users):
        admit()
    cpu0, t0 = me.cpu_times(), time.monotonic()
    while done < jobs:
        for ev in b.step():
            if isinstance(ev, Token):
                tokens += 1
            else:
                done += 1
                if n < jobs:
                    admit()
    cpu1, wall = me.cpu_times(), time.monotonic() - t0
    cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    return {"tokens": tokens, "tok_s": tokens / wall, "cpu_s_per_1k": 1000 * cpu / tokens}
out["one_user"] = run(1, cfg["one_user_jobs"])
out["sixteen_users"] = run(cfg["slots"], 2 * cfg["slots"])
out["uss_after_mib"] = me.memory_full_info().uss / 2**20
print("RESULT " + json.dumps(out))
"""


def engine_run(layout: dict[str, Any], threads: int, tokens: int, prefix_cache: int) -> dict[str, Any]:
    cfg = {"layout": layout, "threads": threads, "tokens": tokens, "slots": SLOTS,
           "prefix_cache": prefix_cache, "prompts": PROMPTS, "one_user_jobs": 4}
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cfg)], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise click.ClickException(f"engine run failed ({layout}):\n{proc.stderr[-3000:]}")
    return dict(json.loads(line[len("RESULT "):]))


def peer_run(ctx: int, threads: int, tokens: int, logs: Path) -> dict[str, Any]:
    """llama-server -np 16 -c ctx under the same 16-user load: tok/s and USS."""
    with start_llama_server(logs, parallel=SLOTS, ctx=ctx, threads=threads) as server:
        proc = psutil.Process(server.process.pid)
        loaded = proc.memory_full_info().uss / MIB
        results: list[int] = []

        def user(i: int) -> None:
            for k in range(2):
                body = {"prompt": PROMPTS[(i + k * SLOTS) % len(PROMPTS)], "n_predict": tokens,
                        "temperature": 0.0, "cache_prompt": True}
                r = httpx.post(f"{server.url}/completion", json=body, timeout=600)
                results.append(int(r.json()["tokens_predicted"]))

        cpu0, t0 = proc.cpu_times(), time.monotonic()
        users = [threading.Thread(target=user, args=(i,)) for i in range(SLOTS)]
        for t in users:
            t.start()
        for t in users:
            t.join()
        cpu1, wall = proc.cpu_times(), time.monotonic() - t0
        cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
        return {"uss_loaded_mib": loaded, "uss_after_mib": proc.memory_full_info().uss / MIB,
                "sixteen_users": {"tokens": sum(results), "tok_s": sum(results) / wall,
                                  "cpu_s_per_1k": 1000 * cpu / sum(results)}}


@click.command()
@click.option("--layouts", default="per-slot-1k,per-slot-4k,unified-16k", show_default=True,
              help=f"comma list of {', '.join(LAYOUTS)}")
@click.option("--threads", type=int, default=None, help="default: the cores we may run on")
@click.option("--tokens", type=int, default=64, show_default=True, help="greedy tokens per job")
@click.option("--prefix-cache", type=int, default=2, show_default=True)
@click.option("--peer/--no-peer", default=True, show_default=True, help="llama-server beside each layout")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=Path("bench-kv-layouts.json"),
              show_default=True)
def main(layouts: str, threads: int | None, tokens: int, prefix_cache: int, peer: bool, out: Path) -> None:
    console = Console(width=150)
    threads = threads or len(psutil.Process().cpu_affinity() or [0])
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kv-layouts-") as tmp:
        for name in layouts.split(","):
            layout, peer_ctx = LAYOUTS[name]
            console.log(f"{name}: engine {layout}, {threads} threads")
            engine = engine_run(layout, threads, tokens, prefix_cache)
            row: dict[str, Any] = {"layout": name, "settings": layout, "engine": engine}
            if peer:
                console.log(f"{name}: llama-server -np {SLOTS} -c {peer_ctx}")
                row["peer_ctx"] = peer_ctx
                row["peer"] = peer_run(peer_ctx, threads, tokens, Path(tmp))
            rows.append(row)

    table = Table(title=f"KV layouts, {SLOTS} slots, {threads} threads, {tokens} greedy tokens per job")
    for col in ("layout", "1 user tok/s", "1 user CPU s/1k", "16 users tok/s", "16 users CPU s/1k", "USS MiB",
                "llama-server -c", "peer 16 users tok/s", "peer CPU s/1k", "peer USS MiB", "USS fleet/peer"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for r in rows:
        e, p = r["engine"], r.get("peer")
        peer_cols = ([str(r["peer_ctx"]), f"{p['sixteen_users']['tok_s']:.1f}",
                      f"{p['sixteen_users']['cpu_s_per_1k']:.1f}", f"{p['uss_after_mib']:.0f}",
                      f"{e['uss_after_mib'] / p['uss_after_mib']:.2f}"] if p else ["-"] * 5)
        table.add_row(r["layout"], f"{e['one_user']['tok_s']:.1f}", f"{e['one_user']['cpu_s_per_1k']:.1f}",
                      f"{e['sixteen_users']['tok_s']:.1f}", f"{e['sixteen_users']['cpu_s_per_1k']:.1f}",
                      f"{e['uss_after_mib']:.0f}", *peer_cols)
    console.print(table)
    out.write_text(json.dumps({"meta": machine_meta(), "slots": SLOTS, "threads": threads, "tokens": tokens,
                               "rows": rows}, indent=1))
    console.print(f"JSON: {out}")


if __name__ == "__main__":
    main()
