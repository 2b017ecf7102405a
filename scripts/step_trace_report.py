"""Where a fleet worker's time went, per phase, from scripts/step_trace's files; beside it what
llama-server's log says of the same run (`fleet bench ... --keep-logs`).

    .venv/bin/python scripts/step_trace_report.py /tmp/trace/chat [--server-log LOG] [--json OUT]

A worker's steps fall into segments split by idle gaps (--gap, default 3 s): the bench's warm-up
and its rounds, the peer's rounds in between. For each: prompt rows and their seconds, and the
decoders' calls by how many decoders they held (the tokens they gave: one a decoder plus the draft
tokens kept), so a round's decode time per token can be set beside llama-server's.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

SERVER_TIMING = re.compile(
    r"id +(\d+) \| task \d+ \| +(prompt eval|eval) time = +([\d.]+) ms / +(\d+) tokens")


def segments(steps: list[dict[str, Any]], gap: float) -> list[list[dict[str, Any]]]:
    out: list[list[dict[str, Any]]] = []
    end = None
    for step in sorted(steps, key=lambda s: s["t"]):
        if end is None or step["t"] - end > gap:
            out.append([])
        out[-1].append(step)
        end = step["t"] + step["s"]
    return out


def phases(steps: list[dict[str, Any]]) -> dict[str, Any]:
    prompt_rows = prompt_s = 0.0
    by_width: dict[int, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0])  # calls, s, tokens, drafted
    for step in steps:
        decoders = [c for c in step["calls"] if c["decoders"]]
        for call in step["calls"]:
            prompt_rows += call["prompt_rows"]
            if call["prompt_rows"] and not call["decoders"]:
                prompt_s += call["s"]
        for call in decoders:  # one decoders' call a step: the step's kept drafts are its
            row = by_width[call["decoders"]]
            row[0] += 1
            row[1] += call["s"]
            row[2] += call["decoders"] + (step["kept"] if len(decoders) == 1 else 0)
            row[3] += bool(call["drafts"])
    decode_s = sum(r[1] for r in by_width.values())
    tokens = sum(r[2] for r in by_width.values())
    return {
        "span_s": round(steps[-1]["t"] + steps[-1]["s"] - steps[0]["t"], 2),
        "busy_s": round(sum(s["s"] for s in steps), 2),
        "prompt_rows": int(prompt_rows), "prompt_s": round(prompt_s, 2),
        "prompt_ms_per_row": round(1000 * prompt_s / prompt_rows, 2) if prompt_rows else None,
        "decode_s": round(decode_s, 2), "tokens": tokens,
        "decode_ms_per_token": round(1000 * decode_s / tokens, 2) if tokens else None,
        "by_decoders": {n: {"calls": r[0], "drafted_calls": r[3], "s": round(r[1], 2), "tokens": r[2],
                            "ms_per_call": round(1000 * r[1] / r[0], 1),
                            "ms_per_token": round(1000 * r[1] / r[2], 1)}
                        for n, r in sorted(by_width.items())},
    }


def server_phases(log: Path) -> dict[str, Any]:
    """llama-server's own timings: prompt tokens it evaluated (its reuse taken off) and the
    milliseconds a slot waited per generated token (with every slot busy: one decode step)."""
    prompt_tokens, per_token = 0, []
    for m in SERVER_TIMING.finditer(log.read_text(errors="replace")):
        if m.group(2) == "prompt eval":
            prompt_tokens += int(m.group(4))
        elif int(m.group(4)) > 1:
            per_token.append(float(m.group(3)) / int(m.group(4)))
    return {"prompt_tokens": prompt_tokens,
            "eval_ms_per_token_p50": round(statistics.median(per_token), 1) if per_token else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefix", help="the STEP_TRACE prefix")
    ap.add_argument("--gap", type=float, default=3.0, help="idle seconds that split segments")
    ap.add_argument("--server-log", type=Path, help="llama-server's log from the same bench")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    console = Console(width=170)
    report: dict[str, Any] = {"workers": {}}
    for path in sorted(glob.glob(f"{args.prefix}.*")):
        steps = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        if not steps:
            continue
        segs = [phases(seg) for seg in segments(steps, args.gap)]
        report["workers"][path] = segs
        table = Table(title=f"{path}: one row per segment (warm-up, then the rounds)")
        for col in ("span s", "busy s", "prompt rows", "prompt ms/row", "decode s", "tokens",
                    "decode ms/token", "by decoders: calls, ms/call, ms/token"):
            table.add_column(col, justify="right")
        for seg in segs:
            widths = "; ".join(f"{n}: {r['calls']}, {r['ms_per_call']}, {r['ms_per_token']}"
                               for n, r in seg["by_decoders"].items())
            table.add_row(*(str(seg[k]) for k in ("span_s", "busy_s", "prompt_rows", "prompt_ms_per_row",
                                                  "decode_s", "tokens", "decode_ms_per_token")), widths)
        console.print(table)
    if args.server_log:
        report["llama_server"] = server_phases(args.server_log)
        console.print(f"llama-server: {report['llama_server']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
        console.print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
