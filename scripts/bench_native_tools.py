#!/usr/bin/env python3
"""A chat with tools whose model answers in words: does it pay for the tools' grammar?

The in-process engine renders chats with a public template (Qwen 2.5's, Hermes tool syntax) on the
embedded model. 40 greedy chats (four forms of ask, ten subjects) run five ways, one job at a
time, the ways' order alternating chat by chat (ABBA):

- `no tools`: the chat alone;
- `native tools`: the same chat with two tools offered (tool_choice auto): the template lists
  them, a lazy grammar waits for `<tool_call>`, the words stream free;
- `tools' prompt as text`: the chat with tools rendered, sent as a plain prompt: the same tokens,
  so (but where drafts or a cached prefix tip a near-tie) the same answer as `native tools`,
  without a grammar. The two compared where their answers are the same text are the grammar's
  own cost with the answer held fixed; `native tools` against `no tools` also holds what the
  tools' text does to the answer (another text, which drafts otherwise) and to every step
  (a longer context to attend to);
- `generic tools`: the same, with `tool_format: generic` (the answer held to the generic
  format's JSON schema from its first token);
- `no tools, as long`: the chat without tools, a system message of filler making its prompt
  about as long as the tools make it: what the longer prompt alone costs.

Decode speed per answer = (tokens - 1) / (its end's time - its first token's): the answer's
tok/s, without the prefill (the tools' text makes the prompt longer). Every answer is max_tokens
long. With `--peer`, a llama-server (`--jinja`, the same template, one slot) answers the same
chats with and without the tools over /v1/chat/completions, streamed, timed the same way from
the client: what the longer prompt costs an engine that has no grammar to pay. Prints a table and
writes JSON.

    .venv/bin/python scripts/bench_native_tools.py --rounds 2 --peer --out bench-native-tools.json
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import httpx
from httpx_sse import connect_sse
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.base import Done, Token  # noqa: E402
from backends.contract import tools  # noqa: E402
from backends.contract.schema import GenerateRequest  # noqa: E402
from backends.contract.text_ops import TextRequest  # noqa: E402
from backends.llamacpp import LlamaCppBackend  # noqa: E402
from backends.llamacpp_settings import LlamaCppSettings  # noqa: E402
from ecosystem.local.bench_setup import machine_meta  # noqa: E402
from ecosystem.local.llama_server import start_llama_server  # noqa: E402

TEMPLATE = ROOT / "tests" / "fixtures" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
TOOLS = [{"name": "get_weather", "description": "The current weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}},
         {"name": "add", "description": "Add two integers.",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                          "b": {"type": "integer"}},
                         "required": ["a", "b"]}}]
# Greedy answers differ with the prompt, and how well an answer drafts is its content's: a few asks
# do not separate the tools' cost from that (one ask read 0.79-0.81x two sessions running, its
# neighbour 1.09x). So many asks, of several forms, each paired with itself across the ways.
FORMS = ("Write a short story about {}.", "Explain how {} works, for a child.",
         "Describe {} in a few sentences.", "List five facts about {}.")
SUBJECTS = ("a lighthouse", "bread", "a puppy", "rain", "chess", "bees", "a detective", "the piano",
            "a volcano", "the moon")
ASKS = [form.format(subject) for form in FORMS for subject in SUBJECTS]


# ~13 tokens; 17 of them make the chat's prompt about as long as the two tools do (~285 tokens)
FILLER = "Background: the weather service and the calculator are available to you today. " * 17


def as_text(b: LlamaCppBackend, request: GenerateRequest) -> GenerateRequest:
    """The chat rendered (tools and all) and sent as a plain prompt: the same tokens, so the same
    greedy answer, without the lazy grammar and its watch."""
    rendered = b.text_op(TextRequest(kind="text", op="apply_template", chat=request))["prompt"]
    body = request.model_dump(exclude_none=True, exclude={"messages", "tools"})
    return GenerateRequest.model_validate({**body, "prompt": rendered})


def chat(ask: str, with_tools: bool, max_tokens: int, as_long: bool = False) -> GenerateRequest:
    # every answer max_tokens long (the template's end of turn is text to this model: no stop)
    messages = [{"role": "user", "content": ask}]
    if as_long:
        messages.insert(0, {"role": "system", "content": FILLER})
    body: dict[str, Any] = {"messages": messages, "temperature": 0.0, "max_tokens": max_tokens,
                            "ignore_eos": True}
    if with_tools:
        body["tools"] = TOOLS
    return GenerateRequest.model_validate(body)


def run_one(b: LlamaCppBackend, request: GenerateRequest) -> dict[str, Any]:
    """One job alone: its decode tok/s and whether it answered in words."""
    if not b.speaks(request):
        request, _ = tools.lower(request)
    b.admit("j", request)
    text: list[str] = []
    stamps: list[float] = []
    calls_at_first = 0
    while True:
        for ev in b.step(0.0):
            if isinstance(ev, Token):
                if not stamps:  # decode calls from here on are steps (the reader may hold text back)
                    calls_at_first = b.executor.decode_calls
                stamps.append(time.perf_counter())
                text.append(ev.text)
            elif isinstance(ev, Done):
                raw = "".join(text)
                in_json = tools.answers_in_json(request) or request.format is not None
                answer = tools.read_answer(raw, "j") if in_json else None
                calls = answer.tool_calls if answer is not None else []
                span = time.perf_counter() - stamps[0] if stamps else 0.0  # first token -> done
                tok_s = (ev.completion_tokens - 1) / span if span else 0.0
                steps = max(1, b.executor.decode_calls - calls_at_first)  # after the first token
                return {"tokens": ev.completion_tokens, "tok_s": tok_s, "called": bool(calls),
                        "prompt_tokens": ev.prompt_tokens, "steps": steps, "s_per_step": span / steps,
                        "answer": answer.content if answer is not None else raw}
            else:
                raise RuntimeError(str(ev))


def run_peer(url: str, ask: str, with_tools: bool, max_tokens: int) -> dict[str, Any]:
    """The same chat on llama-server: its decode tok/s, timed as run_one times the engine's."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": ask}], "temperature": 0.0,
                            "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
    if with_tools:
        body["tools"] = [{"type": "function", "function": t} for t in TOOLS]
    stamps: list[float] = []
    called, tokens, prompt_tokens = False, 0, 0
    with httpx.Client(timeout=600) as client, \
            connect_sse(client, "POST", f"{url}/v1/chat/completions", json=body) as source:
        for sse in source.iter_sse():
            if sse.data == "[DONE]":
                break
            chunk = json.loads(sse.data)
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                called = called or bool(delta.get("tool_calls"))
                if delta.get("content") or delta.get("tool_calls"):
                    stamps.append(time.perf_counter())
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
            prompt_tokens = (chunk.get("usage") or {}).get("prompt_tokens", prompt_tokens)
    span = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
    return {"tokens": tokens, "tok_s": (tokens - 1) / span if span else 0.0, "called": called,
            "prompt_tokens": prompt_tokens}


def paired(runs: list[dict[str, Any]], base: list[dict[str, Any]],
           same_answer: bool = False) -> dict[str, float | None]:
    """Each answer against the same ask's answer without tools in the same round (both in words;
    with `same_answer`, only where the two answers are the same text): the geometric mean of
    those ratios, and all answers' tokens over all their decode time."""
    by_key = {(x["round"], x["ask"]): x for x in base if not x["called"] and x["tok_s"]}
    pairs = [(x, by_key[(x["round"], x["ask"])]) for x in runs
             if not x["called"] and x["tok_s"] and (x["round"], x["ask"]) in by_key]
    if same_answer:
        pairs = [(a, b) for a, b in pairs if a.get("answer") == b.get("answer")]
    if not pairs:
        return {"paired_geomean": None, "pooled_ratio": None, "pairs": 0}

    def pooled(xs: list[dict[str, Any]]) -> float:
        return sum(x["tokens"] - 1 for x in xs) / sum((x["tokens"] - 1) / x["tok_s"] for x in xs)

    return {"paired_geomean": statistics.geometric_mean(a["tok_s"] / b["tok_s"] for a, b in pairs),
            "pooled_ratio": pooled([a for a, _ in pairs]) / pooled([b for _, b in pairs]),
            "pairs": len(pairs)}


@click.command()
@click.option("--rounds", default=2, show_default=True)
@click.option("--asks", default=len(ASKS), show_default=True, help="how many of the asks (forms x subjects)")
@click.option("--max-tokens", default=96, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--draft-max", default=6, show_default=True,
              help="prompt-lookup drafts (the default; a lazy grammar's job drafts until its trigger); 0 "
              "shows the grammar's own cost without drafts")
@click.option("--peer/--no-peer", default=False, show_default=True,
              help="also llama-server --jinja with the same template, with and without the tools")
@click.option("--out", type=click.Path(path_type=Path), default=None)
def main(rounds: int, asks: int, max_tokens: int, threads: int, draft_max: int, peer: bool,
         out: Path | None) -> None:
    console = Console()
    logs = tempfile.TemporaryDirectory(prefix="bench-native-tools-")
    server = (start_llama_server(Path(logs.name), parallel=1, ctx=2048, threads=threads,
                                 extra_args=["--chat-template-file", str(TEMPLATE)]) if peer else None)
    common = {"slots": 1, "chat_template_file": TEMPLATE, "draft_max": draft_max}
    engines = {"native": LlamaCppBackend(LlamaCppSettings(**common), threads=threads),
               "generic": LlamaCppBackend(LlamaCppSettings(**common, tool_format="generic"), threads=threads)}
    # "native tools" and "tools' prompt as text" run back to back, in either order: the same
    # prompt's prefix is cached for whichever runs second, as it is for the other
    ways = {"no tools": ("native", False), "native tools": ("native", True),
            "tools' prompt as text": ("text", True), "generic tools": ("generic", True),
            "no tools, as long": ("long", False)}
    if server is not None:
        ways |= {"llama-server, no tools": ("peer", False), "llama-server, tools": ("peer", True)}
    results: dict[str, list[dict[str, Any]]] = {w: [] for w in ways}
    for r in range(rounds):
        # the ways alternate per chat (ABBA): the box's drift falls on all
        for i, ask in enumerate(ASKS[:asks]):
            for way in list(ways) if (r + i) % 2 == 0 else list(reversed(ways)):
                engine, with_tools = ways[way]
                if engine == "peer" and server:
                    one = run_peer(server.url, ask, with_tools, max_tokens)
                else:
                    b = engines["generic" if engine == "generic" else "native"]
                    request = chat(ask, with_tools, max_tokens, as_long=engine == "long")
                    one = run_one(b, as_text(b, request) if engine == "text" else request)
                results[way].append({"round": r, "ask": i, **one})
        console.print(f"round {r + 1}/{rounds} done")
    summary = {}
    for way, runs in results.items():
        words = [x["tok_s"] for x in runs if not x["called"]]
        base_way = "llama-server, no tools" if way.startswith("llama-server") else "no tools"
        summary[way] = {"answers": len(runs), "in_words": len(words),
                        "tok_s_median": statistics.median(words) if words else None,
                        "prompt_tokens": statistics.median(x["prompt_tokens"] for x in runs),
                        **paired(runs, results[base_way])}
        stepped = [x for x in runs if not x["called"] and x.get("steps")]  # the in-process ways
        if stepped:
            summary[way]["tokens_per_step"] = statistics.median((x["tokens"] - 1) / x["steps"]
                                                                for x in stepped)
            summary[way]["ms_per_step"] = 1000 * statistics.median(x["s_per_step"] for x in stepped)
    # the grammar's own cost, the answer held fixed: the same prompt's tokens as a plain prompt
    # give the same greedy text (but where drafts or a cached prefix changed a near-tie)
    same = paired(results["native tools"], results["tools' prompt as text"], same_answer=True)
    summary["native tools"]["same_answer_vs_text"] = same
    if server is not None:
        server.stop()
    logs.cleanup()
    base = summary["no tools"]["tok_s_median"] or 1.0
    title = (f"Answers in words, one job at a time ({machine_meta()['cpu']}, {threads} threads, "
             f"draft_max {draft_max})")
    table = Table(title=title)
    for col in ("way", "prompt tokens", "answers in words", "decode tok/s (median)",
                "vs no tools (same engine), medians", "paired: geometric mean", "paired: pooled",
                "tokens / step", "ms / step"):
        table.add_column(col)
    for way, s in summary.items():
        tok_s = s["tok_s_median"]
        own = summary["llama-server, no tools"]["tok_s_median"] if way.startswith("llama-server") else base
        s["vs_no_tools"] = tok_s / own if tok_s and own else None
        ratio = f"{s['vs_no_tools']:.3f}x" if s["vs_no_tools"] else "-"
        table.add_row(way, f"{s['prompt_tokens']:.0f}", f"{s['in_words']}/{s['answers']}",
                      f"{tok_s:.1f}" if tok_s else "-", ratio,
                      *(f"{s[k]:.3f}x" if s[k] else "-" for k in ("paired_geomean", "pooled_ratio")),
                      *(f"{s[k]:.2f}" if k in s else "-" for k in ("tokens_per_step", "ms_per_step")))
    console.print(table)
    if same["pairs"]:
        console.print(f"native tools against the tools' prompt as text, the same answer in "
                      f"{same['pairs']} of {len(results['native tools'])} pairs: "
                      f"{same['paired_geomean']:.3f}x (geometric mean), {same['pooled_ratio']:.3f}x (pooled)")
    if out is not None:
        meta = {**machine_meta(), "rounds": rounds, "max_tokens": max_tokens, "threads": threads,
                "draft_max": draft_max}
        out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
