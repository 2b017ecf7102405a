#!/usr/bin/env python3
"""Waves of requests sharing a preamble, on the in-process engine alone (no Redis, no HTTP).

Each wave admits `--users` requests of the shared-prefix workload at once (one ~300-token system
prompt, a distinct question each) and runs them to the end. The first wave meets a preamble that
nothing holds yet; later waves find it in slots, prefix entries or host RAM. Per wave: wall time,
prompt tokens prefilled and reused, the first step's time. With `--compare`, every wave also runs
with newcomers not waiting for a prefix another job is prefilling (the rule in
backends/llamacpp/scheduler.py, MIN_HELD_PREFIX), on an engine of its own, alternated. Prints a
table (with each wave's first tokens: median and last) and writes JSON.

    .venv/bin/python scripts/bench_burst.py --users 16 --waves 3 --compare
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.base import Token  # noqa: E402
from backends.contract.schema import GenerateRequest  # noqa: E402
from backends.llamacpp import LlamaCppBackend, scheduler  # noqa: E402
from backends.llamacpp_settings import LlamaCppSettings  # noqa: E402
from backends.model import default_model_path  # noqa: E402
from ecosystem.local.bench_setup import machine_meta  # noqa: E402
from ecosystem.local.bench_workloads import Tokenizer, Workload  # noqa: E402

COUNTED = ("prompt_tokens_prefilled", "prompt_tokens_reused", "ram_reuses", "steps", "decode_calls",
           "tokens_generated")


def run_wave(engine: LlamaCppBackend, requests: list[GenerateRequest], tag: str) -> dict[str, Any]:
    before = engine.stats()
    t0 = time.perf_counter()
    for i, request in enumerate(requests):
        engine.admit(f"{tag}-{i}", request)
    first_step = None
    first_token: dict[str, float] = {}  # job id -> ms from the wave's start to its first token
    while engine.stats()["active"] or engine.stats()["waiting"]:
        t = time.perf_counter()
        events = engine.step()
        if first_step is None:
            first_step = time.perf_counter() - t
        for ev in events:
            if isinstance(ev, Token) and ev.job_id not in first_token:
                first_token[ev.job_id] = (time.perf_counter() - t0) * 1000
    after = engine.stats()
    out: dict[str, Any] = {k: int(after[k]) - int(before[k]) for k in COUNTED}  # type: ignore[call-overload]
    firsts = sorted(first_token.values()) or [0.0]
    out.update(wall_s=round(time.perf_counter() - t0, 3), first_step_ms=round((first_step or 0) * 1000, 1),
               first_token_p50_ms=round(firsts[len(firsts) // 2], 1),
               first_token_last_ms=round(firsts[-1], 1))
    return out


@click.command()
@click.option("--users", type=int, default=16, show_default=True, help="requests a wave, admitted at once")
@click.option("--waves", type=int, default=3, show_default=True)
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--compare/--no-compare", default=False,
              help="also without waiting for a prefix being prefilled")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=Path("bench-burst.json"))
def main(users: int, waves: int, threads: int, compare: bool, out: Path) -> None:
    console = Console()
    workload = Workload("shared-prefix", Tokenizer(default_model_path()), seed=0)
    modes = ["wait", "no wait"] if compare else ["wait"]
    settings = LlamaCppSettings(slots=users, n_ctx_per_seq=512, n_batch=512)
    engines = {m: LlamaCppBackend(settings, threads=threads) for m in modes}
    waiting_rule = scheduler.MIN_HELD_PREFIX
    rows: list[dict[str, Any]] = []
    for w in range(waves):
        requests = [GenerateRequest(prompt=r.prompt, max_tokens=r.max_tokens, temperature=0.0)
                    for r in workload.requests(w * users, users)]
        for mode in modes if w % 2 == 0 else modes[::-1]:
            scheduler.MIN_HELD_PREFIX = waiting_rule if mode == "wait" else 1 << 30
            rows.append({"wave": w, "mode": mode, **run_wave(engines[mode], requests, f"{mode}-{w}")})
            console.log(rows[-1])
    scheduler.MIN_HELD_PREFIX = waiting_rule
    for engine in engines.values():
        engine.close()
    table = Table(title=f"{users} requests a wave, one preamble ({machine_meta()['cpu']})")
    for col in ("wave", "mode", "wall s", "tok/s", "first step ms", "first token p50 / last ms",
                "prefilled", "reused", "calls"):
        table.add_column(col, justify="right")
    for r in rows:
        tok_s = r["tokens_generated"] / r["wall_s"]
        table.add_row(str(r["wave"]), r["mode"], f"{r['wall_s']:.2f}", f"{tok_s:.0f}",
                      f"{r['first_step_ms']:.0f}",
                      f"{r['first_token_p50_ms']:.0f} / {r['first_token_last_ms']:.0f}",
                      str(r["prompt_tokens_prefilled"]), str(r["prompt_tokens_reused"]),
                      str(r["decode_calls"]))
    console.print(table)
    out.write_text(json.dumps({"meta": machine_meta(), "users": users, "waves": rows}, indent=1))
    console.print(f"JSON: {out}")


if __name__ == "__main__":
    main()
