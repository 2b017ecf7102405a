#!/usr/bin/env python3
"""What a prompt chunk costs beside decoders, in each KV layout: the stall bound's physics.

A paced step (backends/llamacpp/pacing.py) runs the decoders' rows and a long prompt's chunk. With
per-slot KV streams llama.cpp puts them in separate ubatches (`split_equal`: equal rows per
stream), so each step pays the decoders' own pass over the weights and the output layer; only the
unified pool lets one ubatch mix them. This times, on llama.cpp directly (no scheduler, no HTTP):
the chunk alone (no logits), the decoders alone (one row each, with logits), and the two in one
`llama_decode` call in either order, each the median of `--reps` calls after a warm-up, in both
layouts; then the decoders without logits, and what a chunk alone costs at each size from 8 to
512 rows, from which it bounds the long prompt's slowdown at a given longest gap. The KV holds the
decoders' histories and the prompt's prefix, as in `fleet bench --workload stalls` midway. Prints
tables and writes JSON.

Why a mixed ubatch of 64 rows or more costs more than its parts: ggml's CPU flash attention runs
64 query rows at a time (its tiled path, from 64 rows up) over every 64-cell KV tile that any row
of the tile attends to, so a decoder's row in a prompt's tile makes that tile cover all the
decoders' histories too. Below 64 rows each row attends alone.

    .venv/bin/python scripts/bench_mixed_call.py
    .venv/bin/python scripts/bench_mixed_call.py --decoder-context 400 --prompt-past 1500 --chunk 124
"""

from __future__ import annotations

import functools
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import llama_cpp as ll
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.llamacpp.invariance import FA_TILE_ROWS  # noqa: E402
from backends.llamacpp.model import LoadedModel  # noqa: E402
from ecosystem.local.bench_setup import machine_meta  # noqa: E402

SENTENCE = "The town council of Ostrava met on the ninth of May to discuss the bridge and its costs. "
DECODERS = 4
PROMPT_SEQ = DECODERS  # the long prompt's sequence id, after the decoders'
N_BATCH = 512
CALLS = ("chunk", "decoders", "mixed, decoders first", "mixed, chunk first")
CURVE = (8, 16, 32, 48, FA_TILE_ROWS - 1, FA_TILE_ROWS, 96, 128, 192, 256, 384, 512)  # chunks timed alone
BELOW_TILE = FA_TILE_ROWS - 1 - DECODERS  # prompt rows that keep a mixed call under the tiled path


def ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds[1:]) * 1000, 1)  # the first call warms up


def time_calls(unified: bool, decoder_ctx: int, prompt_past: int, chunk: int, reps: int,
               curve: bool = False) -> dict[str, Any]:
    """Median ms of each call shape in one layout (and of a chunk alone at each size in CURVE)."""
    n_seq = DECODERS + 2  # the stalls scenario's slots: 4 streams, 2 long prompts
    model = LoadedModel(None, n_ctx=16384 if unified else 4096 * n_seq, n_batch=N_BATCH, n_seq_max=n_seq,
                        threads=None, kv_unified=unified, swa_full=unified)
    tokens = model.tokenize(SENTENCE * 400, special=False, add_special=True)
    batch = ll.llama_batch_init(N_BATCH, 0, 1)
    memory = ll.llama_get_memory(model.ctx)

    def put(i: int, pos: int, seq: int, logits: bool) -> None:
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = tokens[(pos + 7 * seq) % len(tokens)], pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq, logits

    def decode(n: int) -> float:
        batch.n_tokens = n
        t0 = time.perf_counter()
        rc = ll.llama_decode(model.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return time.perf_counter() - t0

    def prefill(seq: int, count: int) -> None:
        for start in range(0, count, N_BATCH):
            rows = min(N_BATCH, count - start)
            for i in range(rows):
                put(i, start + i, seq, i == rows - 1)
            decode(rows)

    def chunk_rows(n: int, rows: int = chunk) -> int:
        for i in range(rows):
            put(n + i, prompt_past + i, PROMPT_SEQ, False)
        return n + rows

    def decoder_rows(n: int, logits: bool = True) -> int:
        for seq in range(DECODERS):
            put(n + seq, decoder_ctx, seq, logits)
        return n + DECODERS

    def undo() -> None:  # every call starts from the same KV
        ll.llama_memory_seq_rm(memory, PROMPT_SEQ, prompt_past, -1)
        for seq in range(DECODERS):
            ll.llama_memory_seq_rm(memory, seq, decoder_ctx, -1)

    try:
        for seq in range(DECODERS):
            prefill(seq, decoder_ctx)
        prefill(PROMPT_SEQ, prompt_past)
        shapes: dict[str, Callable[[], int]] = {
            "chunk": lambda: chunk_rows(0), "decoders": lambda: decoder_rows(0),
            "mixed, decoders first": lambda: chunk_rows(decoder_rows(0)),
            "mixed, chunk first": lambda: decoder_rows(chunk_rows(0)),
            "decoders, no logits": lambda: decoder_rows(0, logits=False),
            "mixed below 64 rows": lambda: decoder_rows(chunk_rows(0, BELOW_TILE)),
            "chunk below 64 rows": lambda: chunk_rows(0, BELOW_TILE)}
        if curve:
            shapes.update({f"chunk of {n}": functools.partial(chunk_rows, 0, n) for n in CURVE})

        def timed(build: Callable[[], int]) -> float:
            seconds = []
            for _ in range(reps + 1):
                seconds.append(decode(build()))
                undo()
            return ms(seconds)
        return {name: timed(build) for name, build in shapes.items()}
    finally:
        ll.llama_batch_free(batch)


def largest_chunk(curve: dict[int, float], budget_ms: float) -> tuple[float, float]:
    """The most prompt rows a call can hold within budget_ms, and their cost, interpolating
    linearly between the timed sizes (the largest timed size when the budget holds them all)."""
    sizes = sorted(curve)
    for lo, hi in itertools.pairwise(sizes):
        if curve[lo] <= budget_ms < curve[hi]:
            return lo + (budget_ms - curve[lo]) * (hi - lo) / (curve[hi] - curve[lo]), budget_ms
    fits = [n for n in sizes if curve[n] <= budget_ms]
    return (float(fits[-1]), curve[fits[-1]]) if fits else (0.0, 0.0)


def mixed_extra(t: dict[str, float]) -> float:
    """What the decoders add to the chunk's call, in the cheaper order."""
    return min(t["mixed, decoders first"], t["mixed, chunk first"]) - t["chunk"]


def bound(results: dict[str, dict[str, float]], gap_ms: float) -> list[dict[str, Any]]:
    """Per layout: the decoders' cost in a paced step, the largest chunk a step of gap_ms holds
    beside them, and the prompt's slowdown against whole 512-row chunks with the decoders' own
    call between them."""
    curve = {n: results["per-slot"][f"chunk of {n}"] for n in CURVE}
    whole = (curve[512] + results["per-slot"]["decoders"]) / 512
    rows_out = []
    for layout, t in results.items():
        if layout == "per-slot":
            extra = mixed_extra(t)
        else:  # its mixed call pays for 64-row tiles from 64 rows up: the step stays below
            extra = t["mixed below 64 rows"] - t["chunk below 64 rows"]
        sizes = curve if layout == "per-slot" else {n: c for n, c in curve.items() if n < FA_TILE_ROWS}
        rows, cost = largest_chunk(sizes, gap_ms - extra)
        slowdown = (cost + extra) / rows / whole if rows else float("inf")
        rows_out.append({"layout": layout, "decoders_ms": round(extra, 1), "chunk_rows": round(rows),
                         "step_ms": round(cost + extra, 1), "prefill_slowdown": round(slowdown, 2)})
    return rows_out


@click.command()
@click.option("--decoder-context", default=400, show_default=True, help="cells each decoder's history holds")
@click.option("--prompt-past", default=1500, show_default=True, help="the long prompt's rows already in KV")
@click.option("--chunk", default=124, show_default=True, help="prompt rows in the timed chunk")
@click.option("--reps", default=7, show_default=True, help="timed calls per shape (median)")
@click.option("--gap-ms", default=250.0, show_default=True, help="the longest gap to bound the slowdown at")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="JSON file")
def main(decoder_context: int, prompt_past: int, chunk: int, reps: int, gap_ms: float,
         out: Path | None) -> None:
    meta = machine_meta()
    results: dict[str, Any] = {}
    for layout in ("per-slot", "unified"):
        results[layout] = time_calls(layout == "unified", decoder_context, prompt_past, chunk, reps,
                                     curve=layout == "per-slot")
    console = Console(width=150)  # the shapes' table is wide
    table = Table(title=f"One call beside {DECODERS} decoders on {meta.get('cpu', 'this CPU')}: "
                        f"{chunk} prompt rows at {prompt_past}, decoders at {decoder_context} cells (ms)")
    table.add_column("layout")
    extra_calls = ("decoders, no logits", "chunk below 64 rows", "mixed below 64 rows")
    for name in CALLS + extra_calls:
        table.add_column(name, justify="right")
    table.add_column("mixed - chunk", justify="right")
    for layout, t in results.items():
        table.add_row(layout, *(f"{t[c]:.1f}" for c in CALLS + extra_calls), f"{mixed_extra(t):.1f}")
    console.print(table)
    curve = Table(title="A prompt chunk alone (per-slot streams, no logits)")
    for name in ("rows", "ms", "ms a row"):
        curve.add_column(name, justify="right")
    for n in CURVE:
        cost = results["per-slot"][f"chunk of {n}"]
        curve.add_row(str(n), f"{cost:.1f}", f"{cost / n:.2f}")
    console.print(curve)
    bounds = bound(results, gap_ms)
    limit = Table(title=f"Steps of at most {gap_ms:.0f} ms beside the decoders: the long prompt's prefill "
                        "against whole 512-row chunks")
    for name in ("layout", "decoders' share ms", "prompt rows a step", "step ms", "prefill slowdown"):
        limit.add_column(name, justify="right")
    for b in bounds:
        limit.add_row(b["layout"], f"{b['decoders_ms']:.1f}", str(b["chunk_rows"]), f"{b['step_ms']:.1f}",
                      f"{b['prefill_slowdown']:.2f}x")
    console.print(limit)
    path = out or ROOT / "bench-results" / f"mixed-call-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {"decoders": DECODERS, "decoder_context": decoder_context, "prompt_past": prompt_past,
              "chunk": chunk, "reps": reps, "gap_ms": gap_ms}
    report = {"meta": {**meta, "config": config}, "ms": results, "bound": bounds}
    path.write_text(json.dumps(report, indent=2))
    print(f"JSON: {path}")


if __name__ == "__main__":
    main()
