#!/usr/bin/env python3
"""What the KV store costs and saves, per 1,000 tokens, on the in-process engine (no Redis, no HTTP).

For each model (the embedded Q4_K_M, and its Q8_0 copy) and each history length: turn 1 of a chat
(a document of N tokens and a question) runs cold on a writer engine, which stores its KV when it
goes idle; then on a fresh reader engine (another worker, or this one restarted) turn 2 of the
same chat restores the history from the store, and the same turn 2 for another tenant (who may not
see that KV) prefills it all. Reported: prefill ms per 1,000 tokens (turn 1's time to first
token), the writer thread's ms per 1,000 tokens (checksum, file, rename), the entry's bytes per
token, the restore's read-and-check ms per 1,000 tokens, and turn 2's time to first token
restored vs cold (the order alternates by length). Prints a table and writes JSON.

    .venv/bin/python scripts/bench_kv_store.py --tokens 500,1000,2000,3000
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.base import Done, Failed, Token  # noqa: E402
from backends.contract.schema import GenerateRequest, Message  # noqa: E402
from backends.llamacpp import LlamaCppBackend  # noqa: E402
from backends.llamacpp_settings import KvStoreSettings, LlamaCppSettings  # noqa: E402
from backends.model import default_model_path, requantized  # noqa: E402
from ecosystem.local.bench_setup import machine_meta  # noqa: E402
from ecosystem.local.bench_text import paragraph, question  # noqa: E402
from ecosystem.local.bench_workloads import Tokenizer  # noqa: E402


def document(tok: Tokenizer, tokens: int, seed: int) -> str:
    rng = random.Random(f"kv-store-{seed}-{tokens}")
    text = ""
    while tok.count(text) < tokens:
        text += paragraph(rng) + "\n"
    return text


def run(engine: LlamaCppBackend, job_id: str, request: GenerateRequest) -> tuple[float, str, Done]:
    """(ms from admission to the first token, the text, the Done)."""
    t0 = time.perf_counter()
    engine.admit(job_id, request)
    first, text = None, ""
    while True:
        for event in engine.step(0.01):
            if isinstance(event, Failed) and event.job_id == job_id:
                raise RuntimeError(event.error)
            if isinstance(event, Token) and event.job_id == job_id:
                first = first if first is not None else (time.perf_counter() - t0) * 1000
                text += event.text
            if isinstance(event, Done) and event.job_id == job_id:
                return first if first is not None else (time.perf_counter() - t0) * 1000, text, event


def engine(model: Path, store: Path, threads: int, ctx: int) -> LlamaCppBackend:
    return LlamaCppBackend(LlamaCppSettings(model_path=model, slots=2, n_ctx_per_seq=ctx, draft_max=0,
                                            kv_store=KvStoreSettings(path=store, min_tokens=64)),
                           threads=threads)


def stored(writer: LlamaCppBackend, before: int, timeout: float = 60) -> None:
    """Step the idle writer until its entry is on disk."""
    deadline = time.monotonic() + timeout
    assert writer.store is not None
    while writer.store.stats.written <= before:
        if time.monotonic() > deadline:
            raise RuntimeError("the writer stored nothing")
        writer.step(0.01)


def measure(model: Path, lengths: list[int], seed: int, threads: int,
            console: Console) -> list[dict[str, Any]]:
    tok = Tokenizer(model)
    ctx = max(lengths) + 512
    rows = []
    with tempfile.TemporaryDirectory(prefix="kv-store-bench-") as tmp:
        root = Path(tmp)
        writer, reader = engine(model, root, threads, ctx), engine(model, root, threads, ctx)
        try:
            run(writer, "warm-w", GenerateRequest(prompt="Hello", max_tokens=4))  # allocations off the clock
            run(reader, "warm-r", GenerateRequest(prompt="Hello", max_tokens=4))
            for i, n in enumerate(lengths):
                rng = random.Random(f"q-{seed}-{n}")
                history = [Message(role="user", content=document(tok, n, seed) + "\n" + question(rng))]
                turn1 = GenerateRequest(messages=history, max_tokens=16, temperature=0.0, tenant=f"t{n}")
                assert writer.store is not None and reader.store is not None
                ws = writer.store.stats
                w0, wms0, wbytes0 = ws.written, ws.write_ms, ws.written_bytes
                prefill_ms, answer, done1 = run(writer, f"turn1-{n}", turn1)
                stored(writer, w0)
                write_ms, entry_bytes = ws.write_ms - wms0, ws.written_bytes - wbytes0
                again = [*history, Message(role="assistant", content=answer),
                         Message(role="user", content=question(rng))]
                restore = GenerateRequest(messages=again, max_tokens=4, temperature=0.0, tenant=f"t{n}")
                cold = restore.model_copy(update={"tenant": f"cold{n}"})
                order = [("restored", restore), ("cold", cold)]
                ttft: dict[str, float] = {}
                dones: dict[str, Done] = {}
                for name, request in order if i % 2 == 0 else order[::-1]:
                    ttft[name], _, dones[name] = run(reader, f"{name}-{n}", request)
                got = dones["restored"]
                restored = int(got.extra.get("kv_restored_tokens", 0))  # type: ignore[call-overload]
                read_ms = float(got.extra.get("kv_restored_ms", 0.0))  # type: ignore[arg-type]
                kt = done1.prompt_tokens / 1000
                row = {"tokens": done1.prompt_tokens, "prefill_ms": round(prefill_ms, 1),
                       "prefill_ms_per_1k": round(prefill_ms / kt, 1),
                       "write_ms": round(write_ms, 1), "write_ms_per_1k": round(write_ms / kt, 1),
                       "entry_bytes": entry_bytes,
                       "bytes_per_token": round(entry_bytes / done1.prompt_tokens),
                       "restored_tokens": restored, "read_ms": round(read_ms, 1),
                       "read_ms_per_1k": round(read_ms / (restored / 1000), 1) if restored else None,
                       "turn2_prompt_tokens": got.prompt_tokens,
                       "turn2_ttft_restored_ms": round(ttft["restored"], 1),
                       "turn2_ttft_cold_ms": round(ttft["cold"], 1),
                       "speedup": round(ttft["cold"] / ttft["restored"], 1)}
                console.log(f"{model.name} {n}: {row}")
                rows.append(row)
        finally:
            writer.close()
            reader.close()
    return rows


@click.command()
@click.option("--tokens", default="500,1000,2000,3000", show_default=True,
              help="history lengths (prompt tokens of turn 1), comma-separated")
@click.option("--q8/--no-q8", default=True, show_default=True, help="also the embedded model's Q8_0 copy")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=int, default=None, help="default: the cores we may run on")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              default=ROOT / "docs" / "bench-runs" / "kv-store-costs.json", show_default=True)
def main(tokens: str, q8: bool, seed: int, threads: int | None, out: Path) -> None:
    console = Console()
    lengths = [int(t) for t in tokens.split(",") if t.strip()]
    threads = threads or len(os.sched_getaffinity(0))
    q4 = default_model_path()
    models = {"Q4_K_M": q4, **({"Q8_0": requantized(q4, "Q8_0")} if q8 else {})}
    meta = machine_meta()
    results = {label: measure(path, lengths, seed, threads, console) for label, path in models.items()}
    table = Table(title=f"KV store vs prefill on {meta['cpu'] or 'an unnamed CPU'} ({meta['cores']} cores, "
                        f"{threads} threads), per 1,000 tokens")
    for col in ("model", "tokens", "prefill ms/1k", "store write ms/1k", "KB/token", "restore read ms/1k",
                "turn 2 TTFT restored ms", "turn 2 TTFT cold ms", "cold / restored"):
        table.add_column(col, justify="right" if col != "model" else "left")
    for name, rows in results.items():
        for r in rows:
            table.add_row(name, str(r["tokens"]), f"{r['prefill_ms_per_1k']:.0f}",
                          f"{r['write_ms_per_1k']:.0f}", f"{r['bytes_per_token'] / 1024:.1f}",
                          f"{r['read_ms_per_1k']:.0f}" if r["read_ms_per_1k"] is not None else "none",
                          f"{r['turn2_ttft_restored_ms']:.0f}", f"{r['turn2_ttft_cold_ms']:.0f}",
                          f"{r['speedup']:.1f}x")
    console.print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "threads": threads, "models": {k: str(v) for k, v in models.items()},
                               "results": results}, indent=1) + "\n")
    console.print(f"JSON: {out}")


if __name__ == "__main__":
    main()
