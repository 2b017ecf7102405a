"""`fleet bench`'s HTML report: the summary table and its plots (tok/s and TTFT against users,
the fleet against each peer) as inline SVG, one self-contained file beside the JSON and PNG."""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ecosystem.local.bench_report import Ratios, Summary, ratios, workloads_of

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
W, H, PAD_L, PAD_R, PAD_T, PAD_B = 460, 280, 56, 12, 28, 40


def _label(system: str) -> str:
    return system.split(" -np")[0]


def _lines(rows: Sequence[Summary], value: str) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        v = getattr(r, value)
        if v is not None:
            out.setdefault(_label(r.system), []).append((r.users, float(v)))
    return {k: sorted(v) for k, v in out.items()}


def svg_plot(title: str, ylabel: str, lines: dict[str, list[tuple[int, float]]]) -> str:
    """A line plot, users on a log2 x axis; hand-made so the report needs no plotting library."""
    users = sorted({u for pts in lines.values() for u, _ in pts}) or [1]
    top = max([v for pts in lines.values() for _, v in pts] + [1.0]) * 1.1
    lo, hi = math.log2(users[0]), math.log2(users[-1])

    def x(u: int) -> float:
        span = hi - lo
        return PAD_L + (W - PAD_L - PAD_R) * ((math.log2(u) - lo) / span if span else 0.5)

    def y(v: float) -> float:
        return H - PAD_B - (H - PAD_T - PAD_B) * v / top

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" class="plot" role="img" '
             f'aria-label="{html.escape(title)}">',
             f'<text x="{W / 2}" y="16" text-anchor="middle" class="t">{html.escape(title)}</text>']
    for i in range(5):
        v = top * i / 4
        parts.append(f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{y(v):.1f}" y2="{y(v):.1f}" class="g"/>'
                     f'<text x="{PAD_L - 4}" y="{y(v) + 4:.1f}" text-anchor="end">{v:,.0f}</text>')
    for u in users:
        parts.append(f'<text x="{x(u):.1f}" y="{H - PAD_B + 16}" text-anchor="middle">{u}</text>')
    parts.append(f'<text x="{W / 2}" y="{H - 6}" text-anchor="middle">users</text>'
                 f'<text x="12" y="{H / 2}" transform="rotate(-90 12 {H / 2})" text-anchor="middle">'
                 f'{html.escape(ylabel)}</text>')
    for i, (name, pts) in enumerate(lines.items()):
        color = COLORS[i % len(COLORS)]
        points = " ".join(f"{x(u):.1f},{y(v):.1f}" for u, v in pts)
        parts.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2" '
                     f'data-series="{html.escape(name)}"/>')
        parts += [f'<circle cx="{x(u):.1f}" cy="{y(v):.1f}" r="3" fill="{color}"><title>{html.escape(name)}: '
                  f'{u} users, {v:,.1f}</title></circle>' for u, v in pts]
        parts.append(f'<rect x="{PAD_L + 8}" y="{PAD_T + 4 + 16 * i}" width="12" height="3" fill="{color}"/>'
                     f'<text x="{PAD_L + 24}" y="{PAD_T + 9 + 16 * i}" class="l">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:,.1f}" if isinstance(v, float) else html.escape(str(v))


def _ratio_cell(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}x"


def _fleet_ratio(r: Summary, by_key: Ratios, which: str) -> float | None:
    return (by_key.get((r.workload, r.users)) or {}).get(which) if r.role == "fleet" else None


def _plots(rows: Sequence[Summary], workload: str) -> str:
    mine = [r for r in rows if r.workload == workload]
    return "".join([
        svg_plot(f"{workload}: throughput", "tok/s", _lines(mine, "tok_s")),
        svg_plot(f"{workload}: TTFT p50", "ms", _lines(mine, "ttft_p50_ms")),
        svg_plot(f"{workload}: TTFT p95", "ms", _lines(mine, "ttft_p95_ms")),
        svg_plot(f"{workload}: CPU s per 1,000 tokens", "CPU s", _lines(mine, "cpu_s_per_1k_total")),
    ])


def write_html(path: Path, rows: Sequence[Summary], title: str, meta: dict[str, Any],
               png: Path | None = None) -> None:
    by_key = ratios(rows)
    sections = "".join(f"<h2>workload {html.escape(w)}</h2><div class=\"plots\">{_plots(rows, w)}</div>"
                       for w in workloads_of(rows))
    cols = ("workload", "users", "system", "tok_s", "ttft_p50_ms", "ttft_p95_ms", "e2e_p50_ms", "e2e_p95_ms",
            "tokens_per_request", "cpu_s_per_1k_total", "errors", "length_rejected")
    ratio_cols = ("tok_s", "tok_s_median_of_rounds", "ttft_p95")
    body = "".join(
        "<tr>" + "".join(f"<td>{_cell(getattr(r, c))}</td>" for c in cols)
        + "".join(f"<td>{_ratio_cell(_fleet_ratio(r, by_key, c))}</td>" for c in ratio_cols) + "</tr>"
        for r in rows)
    head = "".join(f"<th>{c}</th>" for c in (*cols, "fleet/peer tok/s", "median of rounds",
                                              "fleet/peer TTFT p95"))
    image = ""
    if png is not None and png.exists():
        image = f'<p><img src="{html.escape(png.name)}" alt="matplotlib plot"></p>'
    meta_text = html.escape(json.dumps({k: meta[k] for k in sorted(meta) if k != "config"}, indent=1))
    config = html.escape(json.dumps(meta.get("config", {}), indent=1, default=str))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 16px; color: #222; }}
.plots {{ display: grid; grid-template-columns: repeat(auto-fit, minmax(320px, 1fr)); gap: 12px; }}
.plot {{ width: 100%; height: auto; border: 1px solid #ddd; border-radius: 6px; }}
.plot text {{ font-size: 11px; fill: #555; }} .plot .t {{ font-size: 13px; font-weight: 600; fill: #222; }}
.plot .g {{ stroke: #eee; }} .plot .l {{ fill: #222; }}
table {{ border-collapse: collapse; margin: 12px 0; font-variant-numeric: tabular-nums; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 3px 8px; text-align: right; }}
td:nth-child(1), th:nth-child(1), td:nth-child(3), th:nth-child(3) {{ text-align: left; }}
pre {{ background: #f6f6f6; padding: 8px; overflow-x: auto; font-size: 12px; }}
img {{ max-width: 100%; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
{sections}
<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>
{image}
<details><summary>machine and configuration</summary><pre>{meta_text}</pre><pre>{config}</pre></details>
</body></html>
""", encoding="utf-8")
