#!/usr/bin/env python3
"""What one decode step costs at N rows: the fleet's engine against llama-server, same prompts.

Every later token of a conversation is a decode step; when neither side drafts, a step of N
decoders is the same work on both (N rows through the model, N rows of logits over the
vocabulary). This times it: N jobs of one prompt of ~C tokens each (`--context`), greedy, no
drafts, on the in-process engine (the median step while all N decode, from
`LlamaCppBackend.step`, split into its llama_decode call and the Python around it: sampling,
scheduling, bookkeeping) and on `llama-server -np N` (the median of its own
`predicted_per_token_ms` over N concurrent `/completion` requests), alternated by round. Prints a
table and writes JSON.

    .venv/bin/python scripts/bench_decode_step.py --rows 1,4,16 --rounds 2
    .venv/bin/python scripts/bench_decode_step.py --rows 1,4,16 --context 1000,3000
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

SENTENCE = "You are a helpful assistant who answers briefly and plainly. "  # 12 tokens


def prompts(n: int, round_: int, context: int) -> list[str]:
    preamble = SENTENCE * max(1, context // 12)
    return [f"{preamble}Question {i}.{round_}: what can you tell me about the number {7 * i + round_}?"
            for i in range(n)]


def ctx_per_job(context: int, tokens: int) -> int:
    return -(-(context + tokens + 64) // 256) * 256


def engine_ms(engine: LlamaCppBackend, n: int, round_: int, tokens: int, context: int) -> tuple[float, float]:
    """Median step while all n jobs decode (steps that prefill are left out), and the median of
    those steps' llama_decode time."""
    for i, prompt in enumerate(prompts(n, round_, context)):
        engine.admit(f"r{round_}-{n}-{i}", GenerateRequest(prompt=prompt, max_tokens=tokens, temperature=0.0))
    steps: list[float] = []
    decodes: list[float] = []
    while engine.stats()["active"] or engine.stats()["waiting"]:
        before = engine.stats()
        decoded = engine.executor.decode_seconds  # unrounded (stats() rounds to ms)
        t = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - t
        after = engine.stats()
        if (before["active"] == after["active"] == n and not before["waiting"]
                and after["prompt_tokens_prefilled"] == before["prompt_tokens_prefilled"]):
            steps.append(seconds)
            decodes.append(engine.executor.decode_seconds - decoded)
    return statistics.median(steps) * 1000, statistics.median(decodes) * 1000


def peer_ms(n: int, round_: int, tokens: int, threads: int, logs: Path, context: int) -> float:
    """Median of llama-server's own per-token decode time over n concurrent requests. The prompts
    are prefilled first (one token each, cached in their slots), so that the timed requests decode
    side by side: the server interleaves one slot's prefill with the others' decoding, and a
    request's per-token time would otherwise hold the other prompts' prefill."""
    ctx = n * ctx_per_job(context, tokens)
    with start_llama_server(logs, parallel=n, ctx=ctx, threads=threads) as server:
        per_token: list[float] = []

        def user(prompt: str, predict: int) -> None:
            body = {"prompt": prompt, "n_predict": predict, "temperature": 0.0, "cache_prompt": True}
            r = httpx.post(f"{server.url}/completion", json=body, timeout=600)
            if predict > 1:
                per_token.append(float(r.json()["timings"]["predicted_per_token_ms"]))

        for predict in (1, tokens):
            users = [threading.Thread(target=user, args=(p, predict)) for p in prompts(n, round_, context)]
            for t in users:
                t.start()
            for t in users:
                t.join()
        return statistics.median(per_token)


@click.command()
@click.option("--rows", default="1,4,16", show_default=True, help="decoders at once, comma list")
@click.option("--rounds", type=int, default=2, show_default=True, help="alternating which side goes first")
@click.option("--context", default="300", show_default=True,
              help="prompt tokens of each job (about), comma list: each a level of its own")
@click.option("--tokens", type=int, default=64, show_default=True)
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("bench-decode-step.json"))
def main(rows: str, context: str, rounds: int, tokens: int, threads: int, out: Path) -> None:
    console = Console()
    sizes = [int(x) for x in rows.split(",")]
    contexts = [int(x) for x in context.split(",")]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as logs:
        for cells in contexts:
            per_job = ctx_per_job(cells, tokens)
            settings = LlamaCppSettings(slots=max(sizes), n_ctx_per_seq=per_job, draft_max=0)
            engine = LlamaCppBackend(settings, threads=threads)
            for round_ in range(rounds):
                for n in sizes:
                    sides = ["engine", "llama-server"][:: 1 if round_ % 2 == 0 else -1]
                    got: dict[str, Any] = {"rows": n, "context": cells, "round": round_}
                    for side in sides:
                        if side == "engine":
                            step, decode = engine_ms(engine, n, round_, tokens, cells)
                            got["engine"], got["engine_decode"] = round(step, 2), round(decode, 2)
                        else:
                            got[side] = round(peer_ms(n, round_, tokens, threads, Path(logs), cells), 2)
                    results.append(got)
                    console.log(got)
            engine.close()
    table = Table(title=f"ms per decode step, no drafts ({machine_meta()['cpu']}, {threads} threads)")
    for col in ("rows", "prompt tokens", "engine ms", "of it llama_decode", "of it Python",
                "llama-server ms", "engine / llama-server", "llama_decode / llama-server"):
        table.add_column(col, justify="right")
    for cells in contexts:
        for n in sizes:
            level = [r for r in results if r["rows"] == n and r["context"] == cells]
            mine, decode, peer = (statistics.median(r[k] for r in level)
                                  for k in ("engine", "engine_decode", "llama-server"))
            table.add_row(str(n), str(cells), f"{mine:.1f}", f"{decode:.1f}", f"{mine - decode:.1f}",
                          f"{peer:.1f}", f"{mine / peer:.2f}x", f"{decode / peer:.2f}x")
    console.print(table)
    out.write_text(json.dumps({"meta": machine_meta(), "tokens": tokens, "runs": results}, indent=1))
    console.print(f"JSON: {out}")


if __name__ == "__main__":
    main()
