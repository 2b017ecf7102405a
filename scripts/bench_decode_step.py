#!/usr/bin/env python3
"""What one decode step costs at N rows: the fleet's engine against llama-server, same prompts.

Every later token of a conversation is a decode step; when neither side drafts, a step of N
decoders is the same work on both (N rows through the model, N rows of logits over the
vocabulary). This times it: N jobs of one ~300-token prompt each, greedy, no drafts, on the
in-process engine (the median step while all N decode, from `LlamaCppBackend.step`) and on
`llama-server -np N` (the median of its own `predicted_per_token_ms` over N concurrent
`/completion` requests), alternated by round. Prints a table and writes JSON.

    .venv/bin/python scripts/bench_decode_step.py --rows 1,4,16 --rounds 2
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import click
import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.contract.schema import GenerateRequest  # noqa: E402
from backends.llamacpp import LlamaCppBackend  # noqa: E402
from backends.llamacpp_settings import LlamaCppSettings  # noqa: E402
from ecosystem.local.bench_setup import machine_meta  # noqa: E402
from ecosystem.local.llama_server import start_llama_server  # noqa: E402

PREAMBLE = "You are a helpful assistant who answers briefly and plainly. " * 30
CTX_PER_JOB = 1024


def prompts(n: int, round_: int) -> list[str]:
    return [f"{PREAMBLE}Question {i}.{round_}: what can you tell me about the number {7 * i + round_}?"
            for i in range(n)]


def engine_ms(engine: LlamaCppBackend, n: int, round_: int, tokens: int) -> float:
    """Median step while all n jobs decode (steps that prefill are left out)."""
    for i, prompt in enumerate(prompts(n, round_)):
        engine.admit(f"r{round_}-{n}-{i}", GenerateRequest(prompt=prompt, max_tokens=tokens, temperature=0.0))
    steps: list[float] = []
    while engine.stats()["active"] or engine.stats()["waiting"]:
        before = engine.stats()
        t = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - t
        after = engine.stats()
        if (before["active"] == after["active"] == n and not before["waiting"]
                and after["prompt_tokens_prefilled"] == before["prompt_tokens_prefilled"]):
            steps.append(seconds)
    return statistics.median(steps) * 1000


def peer_ms(n: int, round_: int, tokens: int, threads: int, logs: Path) -> float:
    """Median of llama-server's own per-token decode time over n concurrent requests."""
    with start_llama_server(logs, parallel=n, ctx=n * CTX_PER_JOB, threads=threads) as server:
        per_token: list[float] = []

        def user(prompt: str) -> None:
            body = {"prompt": prompt, "n_predict": tokens, "temperature": 0.0, "cache_prompt": True}
            r = httpx.post(f"{server.url}/completion", json=body, timeout=600)
            per_token.append(float(r.json()["timings"]["predicted_per_token_ms"]))

        users = [threading.Thread(target=user, args=(p,)) for p in prompts(n, round_)]
        for t in users:
            t.start()
        for t in users:
            t.join()
        return statistics.median(per_token)


@click.command()
@click.option("--rows", default="1,4,16", show_default=True, help="decoders at once, comma list")
@click.option("--rounds", type=int, default=2, show_default=True, help="alternating which side goes first")
@click.option("--tokens", type=int, default=64, show_default=True)
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("bench-decode-step.json"))
def main(rows: str, rounds: int, tokens: int, threads: int, out: Path) -> None:
    console = Console()
    sizes = [int(x) for x in rows.split(",")]
    engine = LlamaCppBackend(LlamaCppSettings(slots=max(sizes), n_ctx_per_seq=CTX_PER_JOB, draft_max=0),
                             threads=threads)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as logs:
        for round_ in range(rounds):
            for n in sizes:
                sides = ["engine", "llama-server"][:: 1 if round_ % 2 == 0 else -1]
                got: dict[str, Any] = {"rows": n, "round": round_}
                for side in sides:
                    got[side] = round(engine_ms(engine, n, round_, tokens) if side == "engine"
                                      else peer_ms(n, round_, tokens, threads, Path(logs)), 2)
                results.append(got)
                console.log(got)
    engine.close()
    table = Table(title=f"ms per decode step, no drafts ({machine_meta()['cpu']}, {threads} threads)")
    for col in ("rows", "engine ms", "llama-server ms", "engine / llama-server"):
        table.add_column(col, justify="right")
    for n in sizes:
        mine = statistics.median(r["engine"] for r in results if r["rows"] == n)
        peer = statistics.median(r["llama-server"] for r in results if r["rows"] == n)
        table.add_row(str(n), f"{mine:.1f}", f"{peer:.1f}", f"{mine / peer:.2f}x")
    console.print(table)
    out.write_text(json.dumps({"meta": machine_meta(), "tokens": tokens, "runs": results}, indent=1))
    console.print(f"JSON: {out}")


if __name__ == "__main__":
    main()
