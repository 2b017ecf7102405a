#!/usr/bin/env python3
"""What a prompt chunk costs beside decoders, in each KV layout: the stall bound's physics.

A paced step (backends/llamacpp/pacing.py) runs the decoders' rows and a long prompt's chunk. With
per-slot KV streams llama.cpp puts them in separate ubatches (`split_equal`: equal rows per
stream), so each step pays the decoders' own pass over the weights and the output layer; only the
unified pool lets one ubatch mix them. This times, on llama.cpp directly (no scheduler, no HTTP):
the chunk alone (no logits), the decoders alone (one row each, with logits), and the two in one
`llama_decode` call in either order, each the median of `--reps` calls after a warm-up, in both
layouts. The KV holds the decoders' histories and the prompt's prefix, as in
`fleet bench --workload stalls` midway. Prints a table and writes JSON.

    .venv/bin/python scripts/bench_mixed_call.py
    .venv/bin/python scripts/bench_mixed_call.py --decoder-context 400 --prompt-past 1500 --chunk 124
"""

from __future__ import annotations

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

from backends.llamacpp.model import LoadedModel  # noqa: E402
from ecosystem.local.bench_setup import machine_meta  # noqa: E402

SENTENCE = "The town council of Ostrava met on the ninth of May to discuss the bridge and its costs. "
DECODERS = 4
PROMPT_SEQ = DECODERS  # the long prompt's sequence id, after the decoders'
N_BATCH = 512
CALLS = ("chunk", "decoders", "mixed, decoders first", "mixed, chunk first")


def time_calls(unified: bool, decoder_ctx: int, prompt_past: int, chunk: int, reps: int) -> dict[str, float]:
    """Median ms of each call shape in one layout."""
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

    def chunk_rows(n: int) -> int:
        for i in range(chunk):
            put(n + i, prompt_past + i, PROMPT_SEQ, False)
        return n + chunk

    def decoder_rows(n: int) -> int:
        for seq in range(DECODERS):
            put(n + seq, decoder_ctx, seq, True)
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
            "mixed, chunk first": lambda: decoder_rows(chunk_rows(0))}
        out = {}
        for name, build in shapes.items():
            seconds = []
            for _ in range(reps + 1):
                seconds.append(decode(build()))
                undo()
            out[name] = round(statistics.median(seconds[1:]) * 1000, 1)  # the first call warms up
        return out
    finally:
        ll.llama_batch_free(batch)


@click.command()
@click.option("--decoder-context", default=400, show_default=True, help="cells each decoder's history holds")
@click.option("--prompt-past", default=1500, show_default=True, help="the long prompt's rows already in KV")
@click.option("--chunk", default=124, show_default=True, help="prompt rows in the timed chunk")
@click.option("--reps", default=7, show_default=True, help="timed calls per shape (median)")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="JSON file")
def main(decoder_context: int, prompt_past: int, chunk: int, reps: int, out: Path | None) -> None:
    meta = machine_meta()
    results: dict[str, Any] = {}
    for layout in ("per-slot", "unified"):
        results[layout] = time_calls(layout == "unified", decoder_context, prompt_past, chunk, reps)
    table = Table(title=f"One call beside {DECODERS} decoders on {meta.get('cpu', 'this CPU')}: "
                        f"{chunk} prompt rows at {prompt_past}, decoders at {decoder_context} cells (ms)")
    table.add_column("layout")
    for name in CALLS:
        table.add_column(name, justify="right")
    table.add_column("mixed - chunk", justify="right")
    for layout, ms in results.items():
        mixed = min(ms["mixed, decoders first"], ms["mixed, chunk first"])
        table.add_row(layout, *(f"{ms[c]:.1f}" for c in CALLS), f"{mixed - ms['chunk']:.1f}")
    Console().print(table)
    path = out or ROOT / "bench-results" / f"mixed-call-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {"decoders": DECODERS, "decoder_context": decoder_context, "prompt_past": prompt_past,
              "chunk": chunk, "reps": reps}
    path.write_text(json.dumps({"meta": {**meta, "config": config}, "ms": results}, indent=2))
    print(f"JSON: {path}")


if __name__ == "__main__":
    main()
