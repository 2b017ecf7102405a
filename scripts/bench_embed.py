#!/usr/bin/env python3
"""Embedding throughput: texts/s at batch 32, the fleet against llama-server, same model, same run.

Systems (one client, one request of `--batch` texts at a time, `--texts` texts per run):
- the Python API: `Fleet.embed` -> Redis -> one in-process fleet worker (its embedding context);
- `fleet serve`'s POST /v1/embeddings in front of the same worker;
- `llama-server --embeddings --pooling mean -kvu -np BATCH` (built by scripts/build-llama-server)
  and its own POST /v1/embeddings. `-kvu`: with one KV stream per slot (its default) this
  llama-server pools every input but the first of a batch wrongly (docs/gateway.md).

The systems run in ABBA order (`--rounds` rounds, the order reversed every other round): the box
may be shared, so only ratios within one run mean anything, and each fleet run is compared with
the llama-server run of its own round (the load moves between rounds); the median of those
ratios is the headline. Each run's vectors are checked
against the others' (cosine) so a fast wrong answer cannot win.

    .venv/bin/python scripts/bench_embed.py --texts 192 --rounds 2 \\
        --out docs/bench-runs/2026-11-25-s25-embed.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dispatcher import Fleet  # noqa: E402
from ecosystem.local.bench import machine_meta  # noqa: E402
from ecosystem.local.llama_server import start_llama_server  # noqa: E402
from ecosystem.local.processes import RedisServer, start_gateway, start_worker, wait_until_healthy  # noqa: E402

WORDS = ["the", "river", "city", "market", "light", "winter", "garden", "station", "report", "engine",
         "quiet", "north", "table", "letter", "music", "harbour", "paper", "forest", "bridge", "morning",
         "data", "model", "cloud", "signal", "budget", "school", "doctor", "window", "coffee", "travel",
         "summer", "kitchen", "border", "energy", "history", "question", "answer"]
Embed = Callable[[list[str]], list[list[float]]]


def texts(n: int, seed: int) -> list[str]:
    """`n` sentences of 20-80 words (about 25-100 tokens), the same for every system."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80))).capitalize() + "."
            for _ in range(n)]


def openai_route(url: str, model: str) -> Embed:
    client = httpx.Client(base_url=url, timeout=600)

    def embed(batch: list[str]) -> list[list[float]]:
        r = client.post("/v1/embeddings", json={"model": model, "input": batch})
        r.raise_for_status()
        return [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]

    return embed


def run(name: str, embed: Embed, corpus: list[str], batch: int) -> dict[str, Any]:
    embed(corpus[:batch])  # warm: contexts made, pages touched
    vectors: list[list[float]] = []
    t0 = time.perf_counter()
    for i in range(0, len(corpus), batch):
        vectors += embed(corpus[i:i + batch])
    seconds = time.perf_counter() - t0
    return {"system": name, "texts": len(corpus), "seconds": round(seconds, 3),
            "texts_per_s": round(len(corpus) / seconds, 2), "vectors": vectors}


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=192)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=len(psutil.Process().cpu_affinity() or [0, 1]))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-embed.json")
    args = parser.parse_args()
    console = Console() if sys.stdout.isatty() else Console(width=140)
    corpus = texts(args.texts, args.seed)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-embed-") as tmp, contextlib.ExitStack() as stack:
        logs = Path(tmp) / "logs"
        redis = stack.enter_context(RedisServer.start(Path(tmp) / "redis"))
        worker = start_worker(redis.url, "bench-e1", logs, timeout=180, backend__slots=4,
                              backend__threads=args.threads, backend__embed_batch=args.batch)
        stack.callback(worker.stop)
        gw = start_gateway(redis.url, logs)
        stack.callback(gw.stop)
        wait_until_healthy(gw, 60)
        server = stack.enter_context(start_llama_server(
            logs, parallel=args.batch, ctx=args.batch * 512, threads=args.threads,
            extra_args=["--embeddings", "--pooling", "mean", "-kvu"]))
        fleet = Fleet(redis.url)
        systems: list[tuple[str, Embed]] = [
            ("fleet Python API (Fleet.embed)", lambda batch: fleet.embed(batch, timeout=600)),
            ("fleet serve /v1/embeddings", openai_route(gw.url, "llm")),
            (f"llama-server --embeddings -np {args.batch} /v1/embeddings", openai_route(server.url, "any")),
        ]
        for rnd in range(args.rounds):
            order = systems if rnd % 2 == 0 else systems[::-1]  # ABBA
            for name, embed in order:
                runs.append({**run(name, embed, corpus, args.batch), "round": rnd})
                console.log(f"round {rnd}: {name}: {runs[-1]['texts_per_s']} texts/s")
    names = [name for name, _ in systems]
    reference = next(r["vectors"] for r in runs if r["system"] == names[-1])
    rows = []
    for name in names:
        mine = [r for r in runs if r["system"] == name]
        agree = min(cosine(a, b) for r in mine for a, b in zip(r["vectors"], reference, strict=True))
        median = statistics.median(r["texts_per_s"] for r in mine)
        rows.append({"system": name, "texts_per_s": round(median, 2),
                     "runs": [r["texts_per_s"] for r in mine],
                     "min_cosine_vs_llama_server": round(agree, 6)})
    # the load of a shared box moves between rounds: each fleet run is compared with the
    # llama-server run of its own round, and the median of those ratios is the headline
    peer_runs = rows[-1]["runs"]
    for row in rows:
        row["ratio_per_round"] = [round(x / p, 2) for x, p in zip(row["runs"], peer_runs, strict=True)]
        row["ratio"] = round(statistics.median(row["ratio_per_round"]), 2)
    ratios = {f"{row['system']} / llama-server": row["ratio"] for row in rows[:-1]}
    meta = machine_meta()
    table = Table(title=f"Embeddings: {args.texts} texts (20-80 words), batch {args.batch}, {args.rounds} "
                        f"round(s) ABBA, on {meta['cpu']} ({meta['cores']} cores)")
    for column in ("system", "texts/s per round", "vs llama-server per round", "median ratio",
                   "min cosine vs llama-server"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["system"], ", ".join(f"{x:.1f}" for x in row["runs"]),
                      ", ".join(f"{x:.2f}" for x in row["ratio_per_round"]), f"{row['ratio']:.2f}x",
                      f"{row['min_cosine_vs_llama_server']:.5f}")
    console.print(table)
    out = {"meta": {**meta, "args": vars(args), "note": "same-run ratios on a shared box; absolute "
                    "numbers depend on what else ran"},
           "rows": rows, "ratios": ratios}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    console.log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
