"""Numbers and output of `fleet bench`: per-run summaries, the rich table, JSON and an optional plot."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ecosystem.local.bench_load import LoadResult, Sample
from ecosystem.local.bench_workloads import is_length_rejection

FLEET, PEER = "fleet", "peer"  # the two roles compared in every row pair


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


@dataclass
class Run:
    """One closed-loop run of one system at one user count."""

    users: int
    role: str  # FLEET or PEER
    system: str  # human name, e.g. "fleet (llama-cpp)" or "llama-server -np 16"
    round: int
    wall_s: float
    samples: list[Sample]
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds by process group
    workload: str = "short"

    @classmethod
    def of(cls, users: int, role: str, system: str, round_: int, load: LoadResult,
           cpu_s: dict[str, float], workload: str = "short") -> Run:
        return cls(users, role, system, round_, load.wall, load.samples, cpu_s, workload)


@dataclass
class Summary:
    workload: str
    users: int
    role: str
    system: str
    requests: int
    errors: int
    length_rejected: int  # errors that say the prompt does not fit the context (part of errors)
    tokens: int
    wall_s: float
    tok_s: float
    tokens_per_request: float
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    e2e_p50_ms: float | None
    e2e_p95_ms: float | None
    cpu_s_per_1k_tokens: dict[str, float]
    cpu_s_per_1k_total: float | None
    first_error: str | None
    round_tok_s: list[float]  # each round on its own: the spread says how noisy the machine was


def summarise(runs: Sequence[Run]) -> Summary:
    """Pool the rounds of one (workload, users, role): tok/s = all tokens / all wall time."""
    first = runs[0]
    samples = [s for r in runs for s in r.samples]
    ok = [s for s in samples if s.error is None]
    tokens = sum(s.tokens for s in ok)
    wall = sum(r.wall_s for r in runs)
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    e2es = [s.e2e for s in ok]
    cpu: dict[str, float] = {}
    for r in runs:
        for k, v in r.cpu_s.items():
            cpu[k] = cpu.get(k, 0.0) + v
    errors = [s.error for s in samples if s.error is not None]
    return Summary(
        workload=first.workload, users=first.users, role=first.role, system=first.system,
        requests=len(samples), errors=len(errors),
        length_rejected=sum(1 for e in errors if is_length_rejection(e)), tokens=tokens,
        wall_s=round(wall, 3),
        tok_s=round(tokens / wall, 1) if wall > 0 else 0.0,
        tokens_per_request=round(tokens / len(ok), 1) if ok else 0.0,
        ttft_p50_ms=_ms(percentile(ttfts, 50)), ttft_p95_ms=_ms(percentile(ttfts, 95)),
        e2e_p50_ms=_ms(percentile(e2es, 50)), e2e_p95_ms=_ms(percentile(e2es, 95)),
        cpu_s_per_1k_tokens={k: round(v * 1000 / tokens, 2) for k, v in cpu.items()} if tokens else {},
        cpu_s_per_1k_total=round(sum(cpu.values()) * 1000 / tokens, 2) if tokens and cpu else None,
        first_error=errors[0] if errors else None,
        round_tok_s=[round(_tok_s(r), 1) for r in sorted(runs, key=lambda r: r.round)],
    )


def _tok_s(run: Run) -> float:
    tokens = sum(s.tokens for s in run.samples if s.error is None)
    return tokens / run.wall_s if run.wall_s > 0 else 0.0


def summaries(runs: Sequence[Run]) -> list[Summary]:
    """One row per (workload, users, role): workloads in the order they ran, fleet before peer."""
    order = list(dict.fromkeys(r.workload for r in runs))
    keys = sorted({(r.workload, r.users, r.role) for r in runs},
                  key=lambda k: (order.index(k[0]), k[1], k[2] != FLEET))
    return [summarise([r for r in runs if (r.workload, r.users, r.role) == k]) for k in keys]


def workloads_of(rows: Sequence[Summary]) -> list[str]:
    return list(dict.fromkeys(r.workload for r in rows))


Ratios = dict[tuple[str, int], dict[str, float | None]]


def ratios(rows: Sequence[Summary]) -> Ratios:
    """Per (workload, users): fleet/peer for tok/s (pooled, and the median of the rounds' own
    ratios: each round ran both systems back to back, so its ratio saw the same machine), TTFT
    p50 and p95, e2e p50, CPU seconds per 1,000 tokens."""
    out: Ratios = {}
    for key in dict.fromkeys((r.workload, r.users) for r in rows):
        pair = {r.role: r for r in rows if (r.workload, r.users) == key}
        if FLEET not in pair or PEER not in pair:
            continue
        f, p = pair[FLEET], pair[PEER]
        per_round = [x for a, b in zip(f.round_tok_s, p.round_tok_s, strict=False) if (x := _ratio(a, b))]
        out[key] = {
            "tok_s": _ratio(f.tok_s, p.tok_s),
            "tok_s_median_of_rounds": round(statistics.median(per_round), 3) if per_round else None,
            "ttft_p50": _ratio(f.ttft_p50_ms, p.ttft_p50_ms),
            "ttft_p95": _ratio(f.ttft_p95_ms, p.ttft_p95_ms),
            "e2e_p50": _ratio(f.e2e_p50_ms, p.e2e_p50_ms),
            "cpu_s_per_1k": _ratio(f.cpu_s_per_1k_total, p.cpu_s_per_1k_total),
        }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def table(rows: Sequence[Summary], title: str) -> Table:
    """The main table; a workload column only when the rows span several (print_report gives each
    workload its own table, which keeps it narrow enough for a terminal)."""
    t = Table(title=title)
    several = len(workloads_of(rows)) > 1
    for col in ("workload", "users", "system", "tok/s", "fleet/peer", "TTFT p50", "TTFT p95", "e2e p50",
                "e2e p95", "tok/req", "CPU s/1k tok", "errors", "too long")[0 if several else 1:]:
        t.add_column(col, justify="left" if col in ("workload", "system") else "right")
    by_key = ratios(rows)
    for r in rows:
        t.add_row(*[r.workload][:several], str(r.users), r.system, f"{r.tok_s:.1f}",
                  _ratio_cell(r, by_key.get((r.workload, r.users), {})),
                  _fmt_ms(r.ttft_p50_ms), _fmt_ms(r.ttft_p95_ms), _fmt_ms(r.e2e_p50_ms),
                  _fmt_ms(r.e2e_p95_ms), f"{r.tokens_per_request:g}",
                  "-" if r.cpu_s_per_1k_total is None else f"{r.cpu_s_per_1k_total:.1f}",
                  str(r.errors) if r.errors else "", str(r.length_rejected) if r.length_rejected else "",
                  end_section=r.role == PEER)
    return t


def _ratio_cell(r: Summary, ratio: dict[str, float | None]) -> str:
    pooled, median = ratio.get("tok_s"), ratio.get("tok_s_median_of_rounds")
    if r.role != FLEET or not pooled:
        return ""
    return f"{pooled:.2f}x" + (f" (rounds: med {median:.2f}x)" if len(r.round_tok_s) > 1 and median else "")


def cpu_table(rows: Sequence[Summary]) -> Table:
    """Where the CPU went: seconds per 1,000 generated tokens, by process group."""
    groups = list(dict.fromkeys(k for r in rows for k in r.cpu_s_per_1k_tokens))
    t = Table(title="CPU seconds per 1,000 tokens")
    for col in ("workload", "users", "system", *groups, "total"):
        t.add_column(col, justify="left" if col in ("workload", "system") else "right")
    for r in rows:
        cpu = r.cpu_s_per_1k_tokens
        t.add_row(r.workload, str(r.users), r.system, *(f"{cpu[g]:.1f}" if g in cpu else "" for g in groups),
                  f"{sum(cpu.values()):.1f}", end_section=r.role == PEER)
    return t


def _fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f} ms"


def print_report(console: Console, rows: Sequence[Summary], title: str) -> None:
    console.print(f"[bold]{title}")
    for workload in workloads_of(rows):
        console.print(table([r for r in rows if r.workload == workload], f"workload {workload}"))
    console.print(cpu_table(rows))
    for r in rows:
        if r.first_error:
            console.print(f"[red]{r.workload}, {r.system} at {r.users} users: {r.errors} errors "
                          f"({r.length_rejected} rejected for length), e.g. {r.first_error}")


def write_json(path: Path, meta: dict[str, Any], runs: Sequence[Run], rows: Sequence[Summary]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "meta": meta,
        "summary": [asdict(r) for r in rows],
        "ratios_fleet_over_peer": {w: {str(u): v for (w_, u), v in ratios(rows).items() if w_ == w}
                                   for w in workloads_of(rows)},
        "runs": [
            {**{k: v for k, v in asdict(r).items() if k != "samples"},
             "samples": [[_ms(s.ttft), _ms(s.e2e), s.tokens, s.error] for s in r.samples]}
            for r in runs
        ],
    }
    path.write_text(json.dumps(doc, indent=1))


def write_plot(path: Path, rows: Sequence[Summary], title: str) -> bool:
    """tok/s and TTFT p95 against users, one line per system, a row of plots per workload; False
    when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = workloads_of(rows)
    fig, axes = plt.subplots(len(names), 2, figsize=(10, 4 * len(names)), squeeze=False)
    for (ax1, ax2), workload in zip(axes, names, strict=True):
        for role in (FLEET, PEER):
            mine = [r for r in rows if r.role == role and r.workload == workload]
            if not mine:
                continue
            label = mine[0].system.split(" -np")[0]
            users = [r.users for r in mine]
            ax1.plot(users, [r.tok_s for r in mine], marker="o", label=label)
            ax2.plot(users, [r.ttft_p95_ms or 0 for r in mine], marker="o", label=label)
        ax1.set(xlabel="users", ylabel="tok/s", title=f"{workload}: throughput")
        ax2.set(xlabel="users", ylabel="ms", title=f"{workload}: TTFT p95")
        for ax in (ax1, ax2):
            ax.set_xscale("log", base=2)
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
