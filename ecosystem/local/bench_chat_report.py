"""Numbers and output of `fleet bench --workload chat`: per history mode and system the medians
over rounds, ratios over the peer (the last system) as medians of the per-round ratios (each
round ran every system back to back), the rich table and JSON."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ecosystem.local.bench_report import percentile


@dataclass
class ChatRun:
    """Every user's conversation on one system, one history mode, one round."""

    system: str
    history: str
    round: int
    wall_s: float = 0.0
    tokens: int = 0  # completion tokens, as each system reports them
    ttft_first_ms: list[float] = field(default_factory=list)  # turn 1
    ttft_later_ms: list[float] = field(default_factory=list)  # turns 2..
    first_prompt_tokens: int = 0  # turn 1's prompt tokens over all users: both sides render alike
    errors: list[str] = field(default_factory=list)  # a failed turn ends its conversation
    cpu_s: float = 0.0  # CPU seconds of the system's processes (workers, gateway, Redis; or servers)
    cpu_by: dict[str, float] = field(default_factory=dict)  # the same by process group

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def cpu_per_1k(self) -> float | None:
        return self.cpu_s * 1000 / self.tokens if self.tokens else None


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _later(run: ChatRun, q: float) -> float | None:
    return percentile(run.ttft_later_ms, q)


def summarise(runs: Sequence[ChatRun], systems: Sequence[str], histories: Sequence[str]) -> dict[str, Any]:
    """`<history>/<system>` -> medians over the rounds, and the medians of the per-round ratios
    over the peer's run of the same round."""
    peer = systems[-1]
    out: dict[str, Any] = {}
    for history in histories:
        peers = {r.round: r for r in runs if r.system == peer and r.history == history}
        for name in systems:
            mine = [r for r in runs if r.system == name and r.history == history]  # in round order
            pairs = [(r, peers[r.round]) for r in mine if r.round in peers]
            errors = [e for r in mine for e in r.errors]
            out[f"{history}/{name}"] = {
                "tok_s": _median([r.tok_s for r in mine]),
                "ttft_first_p50_ms": _median([percentile(r.ttft_first_ms, 50) for r in mine]),
                "ttft_later_p50_ms": _median([_later(r, 50) for r in mine]),
                "ttft_later_p95_ms": _median([_later(r, 95) for r in mine]),
                "tok_s_vs_peer": _median([_ratio(a.tok_s, b.tok_s) for a, b in pairs]),
                "ttft_later_vs_peer": _median([_ratio(_later(a, 50), _later(b, 50)) for a, b in pairs]),
                "ttft_later_p95_vs_peer": _median([_ratio(_later(a, 95), _later(b, 95)) for a, b in pairs]),
                "cpu_s_per_1k": _median([r.cpu_per_1k for r in mine]),
                "cpu_vs_peer": _median([_ratio(a.cpu_per_1k, b.cpu_per_1k) for a, b in pairs]),
                "cpu_s_per_1k_by": {g: _median([1000 * r.cpu_by[g] / r.tokens for r in mine if r.tokens])
                                    for g in (mine[0].cpu_by if mine else {})},
                "round_tok_s": [round(r.tok_s, 1) for r in mine],
                "errors": len(errors),
                "first_error": errors[0] if errors else None,
            }
    return out


def _cell(value: float | None, fmt: str, unit: str = "") -> str:
    return "-" if value is None else format(value, fmt) + unit


def table(summary: dict[str, Any], peer: str, title: str) -> Table:
    t = Table(title=title)
    for col in ("history", "system", "tok/s", "turn-1 TTFT p50 ms", "later TTFT p50 ms", "later TTFT p95 ms",
                "tok/s vs peer", "later p50 vs peer", "later p95 vs peer", "CPU s/1k tok", "CPU vs peer",
                "errors"):
        t.add_column(col, justify="left" if col in ("history", "system") else "right")
    for key, row in summary.items():
        history, system = key.split("/", 1)
        ratios = [_cell(row[k], ".2f", "x") for k in ("tok_s_vs_peer", "ttft_later_vs_peer",
                                                       "ttft_later_p95_vs_peer")]
        cpu = _cell(row.get("cpu_s_per_1k"), ".1f")
        cpu_ratio = "" if system == peer else _cell(row.get("cpu_vs_peer"), ".2f", "x")
        t.add_row(history, system, _cell(row["tok_s"], ".1f"), _cell(row["ttft_first_p50_ms"], ",.0f"),
                  _cell(row["ttft_later_p50_ms"], ",.0f"), _cell(row["ttft_later_p95_ms"], ",.0f"),
                  *(["", "", ""] if system == peer else ratios), cpu, cpu_ratio, str(row["errors"] or ""),
                  end_section=system == peer)
    return t


def print_report(console: Console, summary: dict[str, Any], peer: str, title: str) -> None:
    console.print(table(summary, peer, title))
    for key, row in summary.items():
        if row["first_error"]:
            console.print(f"[red]{key}: {row['errors']} failed turns, e.g. {row['first_error']}")


def write_json(path: Path, meta: dict[str, Any], summary: dict[str, Any], runs: Sequence[ChatRun]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "summary": summary,
           "runs": [{**asdict(r), "tok_s": r.tok_s, "cpu_s_per_1k": r.cpu_per_1k} for r in runs]}
    path.write_text(json.dumps(doc, indent=1))
