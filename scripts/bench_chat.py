"""Multi-turn chat, measured as users meet both sides: over HTTP, the official `openai` client
streaming `/v1/chat/completions`, against `fleet serve` in front of the fleet and against
llama-server's own HTTP API (its defaults: context checkpoints and the host-RAM prompt cache),
same model, same chat template (gemma), same run, in ABBA order.

U users hold one conversation each: turn 1 is a ~600-token document and a question, every later
turn resends the whole history (the answers as the server gave them: `real`; or each answer
edited by the client before it is resent, as chat UIs trim and reformat: `edited`) and asks a
new question. Later-turn TTFT is what a returning conversation costs.

    .venv/bin/python scripts/bench_chat.py --users 4 --turns 5 --rounds 2 --out chat.json
    .venv/bin/python scripts/bench_chat.py --workers 2 --users 8 ...   # 2 pinned 1-core workers,
        # also the same fleet claiming blind to held prefixes, and 2 llama-servers round robin
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from openai import OpenAI
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ecosystem.local.bench import machine_meta  # noqa: E402
from ecosystem.local.bench_text import paragraph, question  # noqa: E402
from ecosystem.local.llama_server import start_llama_server  # noqa: E402
from ecosystem.local.processes import RedisServer, start_worker  # noqa: E402
from tests.gateway_harness import start_gateway, wait_until_healthy  # noqa: E402

FLEET, BLIND, PEER = "fleet serve", "fleet serve, claims blind to prefixes", "llama-server"


@dataclass
class Run:
    system: str
    history: str
    round: int
    wall_s: float = 0.0
    tokens: int = 0
    ttft_first_ms: list[float] = field(default_factory=list)  # turn 1
    ttft_later_ms: list[float] = field(default_factory=list)  # turns 2..

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


def opening(user: int, round_: int, history: str) -> str:
    """Turn 1: new for every user, round and history mode (never a cache hit of an earlier run)."""
    rng = random.Random(f"chat-{round_}-{history}-{user}")
    doc = " ".join(paragraph(rng) for _ in range(5))
    return f"Here are my notes:\n{doc}\n\n{question(rng)}"


def edit(answer: str) -> str:
    """What a client may resend instead of the answer: reformatted from its first character."""
    return "Answer: " + answer.strip()


def conversation(clients: list[OpenAI], user: int, args: argparse.Namespace, run: Run,
                 lock: threading.Lock) -> None:
    rng = random.Random(f"questions-{run.round}-{user}")
    messages: list[dict[str, str]] = [{"role": "user", "content": opening(user, run.round, run.history)}]
    client = clients[user % len(clients)]
    for turn in range(args.turns):
        started = time.perf_counter()
        first, parts, tokens = None, [], 0
        stream = client.chat.completions.create(
            model="llm", messages=messages, max_tokens=args.max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, user=f"user-{user}")  # type: ignore[call-overload]
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - started
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        ttft = (first or time.perf_counter() - started) * 1000
        answer = "".join(parts)
        with lock:
            run.tokens += tokens
            (run.ttft_first_ms if turn == 0 else run.ttft_later_ms).append(ttft)
        messages += [{"role": "assistant", "content": edit(answer) if run.history == "edited" else answer},
                     {"role": "user", "content": question(rng)}]


def measure(system: str, urls: list[str], history: str, round_: int, args: argparse.Namespace) -> Run:
    run = Run(system, history, round_)
    clients = [OpenAI(base_url=f"{u}/v1", api_key="none", timeout=600, max_retries=0) for u in urls]
    lock = threading.Lock()
    threads = [threading.Thread(target=conversation, args=(clients, u, args, run, lock))
               for u in range(args.users)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run.wall_s = time.perf_counter() - t0
    return run


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--workers", type=int, default=1, help=">1: pinned one per core (round robin)")
    parser.add_argument("--history", choices=["real", "edited", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=4096, help="tokens per conversation (both sides)")
    parser.add_argument("--out", default="bench-chat.json")
    args = parser.parse_args()
    console = Console() if sys.stdout.isatty() else Console(width=150)
    cores = sorted(psutil.Process().cpu_affinity() or [0])
    threads = len(cores)
    histories = ["real", "edited"] if args.history == "both" else [args.history]
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="bench-chat-") as tmp, contextlib.ExitStack() as stack:
        logs = Path(tmp) / "logs"
        fleets: dict[str, list[str]] = {}
        for system, placement in [(FLEET, True), (BLIND, False)][: 2 if args.workers > 1 else 1]:
            redis = stack.enter_context(RedisServer.start(Path(tmp) / f"redis-{placement}"))
            for i in range(args.workers):
                pin: dict[str, Any] = ({"cpus": str(cores[i % len(cores)]), "backend__threads": 1}
                                       if args.workers > 1 else {})
                w = start_worker(redis.url, f"chat-{placement}-{i}", logs, timeout=180, placement=placement,
                                 backend__slots=args.users, backend__n_ctx_per_seq=args.ctx,
                                 backend__chat_template="gemma", **pin)
                stack.callback(w.stop)
            gw = start_gateway(redis.url, logs, name=f"gateway-{placement}")
            stack.callback(gw.stop)
            wait_until_healthy(gw, 60)
            fleets[system] = [gw.url]
        servers = []
        per_server = max(1, args.users // args.workers)
        for i in range(args.workers):
            # llama.cpp's built-in gemma template, as the fleet's: with jinja (the server's default)
            # `--chat-template gemma` is read as a template of its own and renders "gemma"
            extra = ["--no-jinja", "--chat-template", "gemma"]
            pin_threads = 1 if args.workers > 1 else threads
            srv = stack.enter_context(start_llama_server(logs, parallel=per_server, ctx=per_server * args.ctx,
                                                         threads=pin_threads, extra_args=extra))
            if args.workers > 1:
                psutil.Process(srv.process.pid).cpu_affinity([cores[i % len(cores)]])
            servers.append(srv.url)
        peer = PEER if args.workers == 1 else f"{args.workers} llama-servers, round robin"
        systems = [*fleets.items(), (peer, servers)]
        console.log(f"{args.users} users x {args.turns} turns, {args.max_tokens} tokens, "
                    f"{args.workers} worker(s) / server(s), {machine_meta().get('cpu', '')}")
        for round_, history in itertools.product(range(args.rounds), histories):
            order = systems if round_ % 2 == 0 else systems[::-1]
            for name, urls in order:
                run = measure(name, urls, history, round_, args)
                runs.append(run)
                console.log(f"round {round_} {history:6} {name}: {run.tok_s:.1f} tok/s, later-turn TTFT "
                            f"p50 {median(run.ttft_later_ms):.0f} ms")
    names = [name for name, _ in systems]
    table = Table(title=f"Multi-turn chat over HTTP: {args.users} users x {args.turns} turns")
    for col in ("history", "system", "tok/s", "turn-1 TTFT p50 ms", "later TTFT p50 ms",
                "tok/s vs peer", "later TTFT vs peer"):
        table.add_column(col)
    summary: dict[str, Any] = {}
    for history in histories:
        for name in names:
            mine = [r for r in runs if r.system == name and r.history == history]
            peers = [r for r in runs if r.system == names[-1] and r.history == history]
            tok_ratio = median([a.tok_s / b.tok_s for a, b in zip(mine, peers, strict=True)])
            ttft_ratio = median([median(a.ttft_later_ms) / median(b.ttft_later_ms)
                                 for a, b in zip(mine, peers, strict=True)])
            row = {"tok_s": median([r.tok_s for r in mine]),
                   "ttft_first_p50_ms": median([median(r.ttft_first_ms) for r in mine]),
                   "ttft_later_p50_ms": median([median(r.ttft_later_ms) for r in mine]),
                   "tok_s_vs_peer": tok_ratio, "ttft_later_vs_peer": ttft_ratio}
            summary[f"{history}/{name}"] = row
            table.add_row(history, name, f"{row['tok_s']:.1f}", f"{row['ttft_first_p50_ms']:.0f}",
                          f"{row['ttft_later_p50_ms']:.0f}", f"{tok_ratio:.2f}x", f"{ttft_ratio:.2f}x")
    console.print(table)
    Path(args.out).write_text(json.dumps({"machine": machine_meta(), "args": vars(args), "summary": summary,
                                          "runs": [r.__dict__ for r in runs]}, indent=2))


if __name__ == "__main__":
    main()
