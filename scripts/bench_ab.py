#!/usr/bin/env python3
"""Two fleet variants through `fleet bench`, alternated: A, B, B, A, A, B, ... (ABBA pairs).

`fleet bench` compares one fleet with llama-server in one run; this compares two fleets (say,
observability on and off, or an older checkout and this one) on the same load. Each run of
`fleet bench` also measures llama-server seconds away from the fleet it ran, so every fleet figure
comes with its own peer: the A/B ratio is read from the fleet/peer ratios (box drift cancels),
and from the raw fleet tok/s beside it. Prints a table and writes JSON.

    .venv/bin/python scripts/bench_ab.py --users 16 --pairs 2 \\
        --a-name "observe on" --b-name "observe off" --b-arg=--worker-set=observe=false
    .venv/bin/python scripts/bench_ab.py --users 16 --pairs 2 \\
        --a-name a19c634 --a-env PYTHONPATH=/work/old --b-name main    # an older checkout vs this
    # a checkout whose `fleet` entry point differs: run its own executable
    .venv/bin/python scripts/bench_ab.py --users 16 --a-name old --a-fleet /work/old/.venv/bin/fleet
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
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

from ecosystem.local.bench import machine_meta  # noqa: E402

FLEET = ROOT / ".venv" / "bin" / "fleet"


def run_bench(name: str, fleet: Path, env_pairs: tuple[str, ...], args: tuple[str, ...], users: int,
              common: tuple[str, ...], out: Path, console: Console) -> dict[str, Any]:
    env = dict(os.environ)
    env.update(_pair(kv) for kv in env_pairs)
    cmd = [str(fleet), "bench", "--users", str(users), "--rounds", "1", *common, *args, "--out", str(out)]
    shown = " ".join(cmd[1:]) + (f"  (env {' '.join(env_pairs)})" if env_pairs else "")
    console.log(f"[bold]{name}[/]: {shown}")
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise click.ClickException(f"{name}: fleet bench failed ({proc.returncode}):\n{proc.stdout[-3000:]}"
                                   f"\n{proc.stderr[-3000:]}")
    data = json.loads(out.read_text())
    ours = next(s for s in data["summary"] if s["role"] == "fleet" and s["users"] == users)
    peer = next(s for s in data["summary"] if s["role"] != "fleet" and s["users"] == users)
    cpu_fleet = sum(ours["cpu_s_per_1k_tokens"].values())
    return {"variant": name, "seconds": round(time.monotonic() - started, 1), "fleet_tok_s": ours["tok_s"],
            "peer_tok_s": peer["tok_s"], "ratio": round(ours["tok_s"] / peer["tok_s"], 3),
            "fleet_ttft_p95_ms": ours["ttft_p95_ms"], "peer_ttft_p95_ms": peer["ttft_p95_ms"],
            "fleet_cpu_s_per_1k": round(cpu_fleet, 2), "errors": ours["errors"], "json": str(out)}


@click.command()
@click.option("--users", type=int, default=16, show_default=True)
@click.option("--pairs", type=click.IntRange(1), default=2, show_default=True, help="A/B pairs (ABBA order)")
@click.option("--a-name", default="A", show_default=True)
@click.option("--b-name", default="B", show_default=True)
@click.option("--a-env", multiple=True, help="KEY=VALUE for variant A's `fleet bench` (repeatable)")
@click.option("--b-env", multiple=True)
@click.option("--a-arg", multiple=True, help="extra `fleet bench` argument for variant A (repeatable)")
@click.option("--b-arg", multiple=True)
@click.option("--a-fleet", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=FLEET,
              help="the `fleet` executable of variant A (default: this checkout's)")
@click.option("--b-fleet", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=FLEET)
@click.option("--bench-arg", multiple=True, help="extra `fleet bench` argument for both (repeatable)")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=Path("bench-ab.json"),
              show_default=True)
def main(users: int, pairs: int, a_name: str, b_name: str, a_env: tuple[str, ...], b_env: tuple[str, ...],
         a_arg: tuple[str, ...], b_arg: tuple[str, ...], a_fleet: Path, b_fleet: Path,
         bench_arg: tuple[str, ...], out: Path) -> None:
    console = Console(width=150)
    variants = {"A": (a_name, a_fleet, a_env, a_arg), "B": (b_name, b_fleet, b_env, b_arg)}
    order = "".join("AB" if i % 2 == 0 else "BA" for i in range(pairs))
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:
        for i, which in enumerate(order):
            name, fleet, env_pairs, args = variants[which]
            out_i = Path(tmp) / f"{i}-{which}.json"
            runs.append(run_bench(name, fleet, env_pairs, args, users, bench_arg, out_i, console))
            console.log(f"  fleet {runs[-1]['fleet_tok_s']} tok/s, peer {runs[-1]['peer_tok_s']}, "
                        f"ratio {runs[-1]['ratio']}")
        for run in runs:  # keep the per-run JSON beside the summary
            kept = out.with_name(f"{out.stem}-{Path(run['json']).name}")
            kept.write_text(Path(run["json"]).read_text())
            run["json"] = str(kept)

    table = Table(title=f"{a_name} vs {b_name}: fleet bench --users {users}, {pairs} ABBA pairs")
    for col in ("variant", "fleet tok/s", "llama-server tok/s", "fleet/peer", "TTFT p95 fleet/peer ms",
                "fleet CPU s/1k tok", "errors"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in runs:
        ttft = f"{r['fleet_ttft_p95_ms']:.0f} / {r['peer_ttft_p95_ms']:.0f}"
        table.add_row(r["variant"], f"{r['fleet_tok_s']:.1f}", f"{r['peer_tok_s']:.1f}", f"{r['ratio']:.3f}",
                      ttft, f"{r['fleet_cpu_s_per_1k']:.2f}", str(r["errors"]))
    console.print(table)

    def b_over_a(key: str) -> float:
        a, b = (statistics.median(r[key] for r in runs if r["variant"] == n) for n in (a_name, b_name))
        return round(b / a, 3)

    summary = {"users": users, "pairs": pairs, "a": a_name, "b": b_name,
               "b_over_a_fleet_tok_s": b_over_a("fleet_tok_s"), "b_over_a_ratio_vs_peer": b_over_a("ratio"),
               "b_over_a_cpu_per_1k": b_over_a("fleet_cpu_s_per_1k")}
    console.print(f"{b_name} / {a_name} (medians): fleet tok/s {summary['b_over_a_fleet_tok_s']}x, "
                  f"fleet/peer {summary['b_over_a_ratio_vs_peer']}x, "
                  f"CPU s/1k tok {summary['b_over_a_cpu_per_1k']}x")
    meta = {**machine_meta(), "loadavg_end": os.getloadavg(), "argv": sys.argv[1:]}
    out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1))
    console.print(f"JSON: {out}")


def _pair(kv: str) -> tuple[str, str]:
    key, _, value = kv.partition("=")
    return key, value


if __name__ == "__main__":
    main()
