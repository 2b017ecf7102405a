#!/usr/bin/env python3
"""A chat with tools whose model answers in words: does it pay for the tools' grammar?

The in-process engine renders chats with a public template (Qwen 2.5's, Hermes tool syntax) on the
embedded model. The same greedy chats run three ways, one job at a time, the ways' order
alternating chat by chat (ABBA):

- `no tools`: the chat alone;
- `native tools`: the same chat with two tools offered (tool_choice auto): the template lists
  them, a lazy grammar waits for `<tool_call>`, the words stream free;
- `generic tools`: the same, with `tool_format: generic` (the answer held to the generic
  format's JSON schema from its first token).

Decode speed per answer = (tokens - 1) / (its end's time - its first token's): the answer's
tok/s, without the prefill (the tools' text makes the prompt longer). Every answer is max_tokens
long. Prints a table and writes JSON.

    .venv/bin/python scripts/bench_native_tools.py --rounds 4 --out bench-native-tools.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.base import Done, Token  # noqa: E402
from backends.contract import tools  # noqa: E402
from backends.contract.schema import GenerateRequest  # noqa: E402
from backends.llamacpp import LlamaCppBackend  # noqa: E402
from backends.llamacpp_settings import LlamaCppSettings  # noqa: E402
from ecosystem.local.bench_setup import machine_meta  # noqa: E402

TEMPLATE = ROOT / "tests" / "fixtures" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
TOOLS = [{"name": "get_weather", "description": "The current weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}},
         {"name": "add", "description": "Add two integers.",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                          "b": {"type": "integer"}},
                         "required": ["a", "b"]}}]
ASKS = [f"Write a short story about {t}." for t in
        ("a lighthouse", "bread", "a puppy", "rain", "chess", "bees", "a detective", "the piano")]


def chat(ask: str, with_tools: bool, max_tokens: int) -> GenerateRequest:
    # every answer max_tokens long (the template's end of turn is text to this model: no stop)
    body: dict[str, Any] = {"messages": [{"role": "user", "content": ask}], "temperature": 0.0,
                            "max_tokens": max_tokens, "ignore_eos": True}
    if with_tools:
        body["tools"] = TOOLS
    return GenerateRequest.model_validate(body)


def run_one(b: LlamaCppBackend, request: GenerateRequest) -> dict[str, Any]:
    """One job alone: its decode tok/s and whether it answered in words."""
    if not b.speaks(request):
        request, _ = tools.lower(request)
    b.admit("j", request)
    text, stamps = [], []
    while True:
        for ev in b.step(0.0):
            if isinstance(ev, Token):
                stamps.append(time.perf_counter())
                text.append(ev.text)
            elif isinstance(ev, Done):
                raw = "".join(text)
                in_json = tools.answers_in_json(request) or request.format is not None
                calls = tools.read_answer(raw, "j").tool_calls if in_json else []
                span = time.perf_counter() - stamps[0] if stamps else 0.0  # first token -> done
                tok_s = (ev.completion_tokens - 1) / span if span else 0.0
                return {"tokens": ev.completion_tokens, "tok_s": tok_s, "called": bool(calls)}
            else:
                raise RuntimeError(str(ev))


@click.command()
@click.option("--rounds", default=4, show_default=True)
@click.option("--max-tokens", default=96, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--draft-max", default=6, show_default=True,
              help="prompt-lookup drafts (the default; a lazy grammar's job drafts until its trigger); 0 "
              "shows the grammar's own cost without drafts")
@click.option("--out", type=click.Path(path_type=Path), default=None)
def main(rounds: int, max_tokens: int, threads: int, draft_max: int, out: Path | None) -> None:
    console = Console()
    common = {"slots": 1, "chat_template_file": TEMPLATE, "draft_max": draft_max}
    engines = {"native": LlamaCppBackend(LlamaCppSettings(**common), threads=threads),
               "generic": LlamaCppBackend(LlamaCppSettings(**common, tool_format="generic"), threads=threads)}
    ways = {"no tools": ("native", False), "native tools": ("native", True),
            "generic tools": ("generic", True)}
    results: dict[str, list[dict[str, Any]]] = {w: [] for w in ways}
    for r in range(rounds):
        for i, ask in enumerate(ASKS):  # the ways alternate per chat (ABBA): the box's drift falls on all
            for way in list(ways) if (r + i) % 2 == 0 else list(reversed(ways)):
                engine, with_tools = ways[way]
                one = run_one(engines[engine], chat(ask, with_tools, max_tokens))
                results[way].append({"round": r, **one})
        console.print(f"round {r + 1}/{rounds} done")
    summary = {}
    for way, runs in results.items():
        words = [x["tok_s"] for x in runs if not x["called"]]
        summary[way] = {"answers": len(runs), "in_words": len(words),
                        "tok_s_median": statistics.median(words) if words else None}
    base = summary["no tools"]["tok_s_median"] or 1.0
    title = (f"Answers in words, one job at a time ({machine_meta()['cpu']}, {threads} threads, "
             f"draft_max {draft_max})")
    table = Table(title=title)
    for col in ("way", "answers in words", "decode tok/s (median)", "vs no tools"):
        table.add_column(col)
    for way, s in summary.items():
        tok_s = s["tok_s_median"]
        s["vs_no_tools"] = tok_s / base if tok_s else None
        table.add_row(way, f"{s['in_words']}/{s['answers']}", f"{tok_s:.1f}" if tok_s else "-",
                      f"{s['vs_no_tools']:.3f}x" if tok_s else "-")
    console.print(table)
    if out is not None:
        meta = {**machine_meta(), "rounds": rounds, "max_tokens": max_tokens, "threads": threads,
                "draft_max": draft_max}
        out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
