#!/usr/bin/env python3
"""A chat's next turn after its worker restarted or its model was unloaded, through `fleet serve`.

Four conversations, each opening with a ~2,000-token document, talk to one catalogue worker
(4 slots) over HTTP (streaming chat completions, the gateway as users meet it). Between turns
the fleet is disturbed, then the next turn of all four is sent at once:

    turn 1  cold (the document prefilled)
    turn 2  warm (its slot holds the history)          -> the warm reference
    turn 3  after a SIGTERM restart (the worker drains, a new process starts)
    turn 4  warm
    turn 5  after kill -9 and a restart
    turn 6  warm
    turn 7  after the model was unloaded and loaded again (`POST /models/unload`, `/models/load`)
    turn 8  warm

After a restart or a reload the model is loaded (`/models/load`) before the turn is sent, so the
TTFT is the turn's own, not the load's. Each system runs the whole sequence: the fleet with a KV
store (`backend.kv_store.path`) and, with `--compare` (default), the same fleet without one,
alternated by round. Prints each event's TTFT p50 over the warm one's and writes JSON.

    .venv/bin/python scripts/bench_kv_restart.py --rounds 1
"""

from __future__ import annotations

import contextlib
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click
import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.model import default_model_path  # noqa: E402
from ecosystem.local.bench_chat import ChatClient  # noqa: E402
from ecosystem.local.bench_setup import machine_meta, workdir  # noqa: E402
from ecosystem.local.bench_text import paragraph, question  # noqa: E402
from ecosystem.local.bench_workloads import Tokenizer  # noqa: E402
from ecosystem.local.processes import (  # noqa: E402
    RedisServer,
    WorkerProcess,
    start_gateway,
    start_worker,
    wait_for,
    wait_until_healthy,
)

MODEL = "gemma3:270m"
EVENTS = ("cold", "warm", "SIGTERM restart", "warm", "kill -9 restart", "warm", "unload, reload", "warm")
WITH_STORE, WITHOUT = "fleet, KV store", "fleet, no KV store"


def opening(tok: Tokenizer, tokens: int, user: int, round_: int, system: str) -> str:
    rng = random.Random(f"restart-{round_}-{system}-{user}")
    text = "Here are my notes:\n"
    while tok.count(text) < tokens:
        text += paragraph(rng) + "\n"
    return text + "\n" + question(rng)


class Fleet:
    """One worker (restartable) and one gateway over a private redis-server."""

    def __init__(self, stack: contextlib.ExitStack, root: Path, store: Path | None, slots: int,
                 threads: int, ctx: int) -> None:
        self.root, self.logs = root, root / "logs"
        self.catalogue = {MODEL: {"path": str(default_model_path()), "keep_alive": -1}}
        self.settings: dict[str, Any] = {
            "models": self.catalogue, "backend__slots": slots, "backend__threads": threads,
            "backend__n_ctx_per_seq": ctx, "backend__chat_template": "gemma", "drain_grace": 60}
        if store is not None:
            self.settings["backend__kv_store__path"] = str(store)
        self.redis = stack.enter_context(RedisServer.start(root / "redis"))
        self.starts = 0
        self.worker = self.start_worker()
        stack.callback(lambda: self.worker.stop(timeout=90))
        self.gateway = start_gateway(self.redis.url, self.logs, models=self.catalogue)
        stack.callback(self.gateway.stop)
        wait_until_healthy(self.gateway, 60)
        self.load()

    def start_worker(self) -> WorkerProcess:
        # a new name each start, as a worker's default (host-pid): a killed one's name stays
        # registered until it looks dead
        self.starts += 1
        name = f"restart-w{self.starts}"
        return start_worker(self.redis.url, name, self.logs, timeout=180, **self.settings)

    def states(self) -> dict[str, str]:
        data = httpx.get(f"{self.gateway.url}/models", timeout=10).json()["data"]
        return {m["id"]: m["status"]["value"] for m in data}

    def load(self) -> None:
        httpx.post(f"{self.gateway.url}/models/load", json={"model": MODEL}, timeout=120).raise_for_status()
        wait_for(lambda: self.states()[MODEL] == "loaded", 120, "the model loaded")

    def disturb(self, event: str) -> None:
        if event == "SIGTERM restart":
            code = self.worker.stop(timeout=120)
            assert code == 0, self.worker.output()[-2000:]
        elif event == "kill -9 restart":
            time.sleep(1.0)  # a kill at some moment after the turn, not in the middle of it
            self.worker.kill()
        elif event == "unload, reload":
            unload = httpx.post(f"{self.gateway.url}/models/unload", json={"model": MODEL}, timeout=30)
            unload.raise_for_status()
            wait_for(lambda: self.states()[MODEL] == "unloaded", 60, "the model unloaded")
        else:
            return
        if not self.worker.alive():
            self.worker = self.start_worker()
            wait_until_healthy(self.gateway, 60)
        self.load()


def next_turn(client: ChatClient, chats: list[list[dict[str, str]]], rngs: list[random.Random],
              max_tokens: int) -> tuple[list[float], list[int], list[str]]:
    """Every conversation's next turn at once: TTFT ms and prompt tokens by user, errors."""
    users = len(chats)
    ttft, prompt, errors = [0.0] * users, [0] * users, []

    def talk(u: int) -> None:
        sample, prompt[u], answer = client.turn(chats[u], max_tokens, u)
        if sample.error is not None:
            errors.append(f"user {u}: {sample.error}")
            return
        ttft[u] = (sample.ttft if sample.ttft is not None else sample.e2e) * 1000
        chats[u] += [{"role": "assistant", "content": answer}, {"role": "user", "content": question(rngs[u])}]

    threads = [threading.Thread(target=talk, args=(u,)) for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ttft, prompt, errors


def run_system(system: str, round_: int, args: dict[str, Any], tok: Tokenizer, root: Path,
               console: Console) -> dict[str, Any]:
    users = args["users"]
    store = root / f"kv-{round_}" if system == WITH_STORE else None
    with contextlib.ExitStack() as stack:
        fleet = Fleet(stack, root / f"{system.replace(' ', '-').replace(',', '')}-{round_}", store,
                      users, args["threads"], args["ctx"])
        client = ChatClient(fleet.gateway.url, users, model=MODEL)
        stack.callback(client.close)
        chats = [[{"role": "user", "content": opening(tok, args["tokens"], u, round_, system)}]
                 for u in range(users)]
        rngs = [random.Random(f"q-{round_}-{u}") for u in range(users)]
        turns: list[dict[str, Any]] = []
        for event in EVENTS:
            fleet.disturb(event)
            ttft, prompt, errors = next_turn(client, chats, rngs, args["max_tokens"])
            if errors:
                raise click.ClickException(f"{system}, {event}: {errors}\n{fleet.worker.output()[-3000:]}")
            turns.append({"event": event, "ttft_ms": [round(x, 1) for x in ttft], "prompt_tokens": prompt,
                          "ttft_p50_ms": round(statistics.median(ttft), 1)})
            console.log(f"round {round_} {system}: {event:>16}  TTFT p50 {statistics.median(ttft):7.0f} ms  "
                        f"(prompts {min(prompt)}-{max(prompt)} tokens)")
    return {"system": system, "round": round_, "turns": turns}


def summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for system in dict.fromkeys(r["system"] for r in runs):
        mine = [t for r in runs if r["system"] == system for t in r["turns"]]
        warm = statistics.median([x for t in mine if t["event"] == "warm" for x in t["ttft_ms"]])
        for event in dict.fromkeys(t["event"] for t in mine):
            if event == "warm":
                continue
            p50 = statistics.median([x for t in mine if t["event"] == event for x in t["ttft_ms"]])
            out.append({"system": system, "event": event, "ttft_p50_ms": round(p50, 1),
                        "warm_p50_ms": round(warm, 1), "over_warm": round(p50 / warm, 2)})
    return out


@click.command()
@click.option("--users", type=int, default=4, show_default=True, help="conversations (and slots)")
@click.option("--tokens", type=int, default=2000, show_default=True, help="the opening document's tokens")
@click.option("--max-tokens", type=int, default=32, show_default=True, help="per answer")
@click.option("--threads", type=int, default=None, help="the worker's threads (default: the cores)")
@click.option("--rounds", type=int, default=1, show_default=True)
@click.option("--compare/--no-compare", default=True, show_default=True,
              help="also the fleet without a store")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              default=ROOT / "docs" / "bench-runs" / "kv-store-restart.json", show_default=True)
@click.option("--keep-logs", is_flag=True)
def main(users: int, tokens: int, max_tokens: int, threads: int | None, rounds: int, compare: bool, out: Path,
         keep_logs: bool) -> None:
    import os

    console = Console()
    meta = machine_meta()
    args = {"users": users, "tokens": tokens, "max_tokens": max_tokens,
            "threads": threads or len(os.sched_getaffinity(0)),
            "ctx": tokens + 512 + len(EVENTS) * (max_tokens + 64)}
    tok = Tokenizer(default_model_path())
    systems = [WITH_STORE, *([WITHOUT] if compare else [])]
    runs = []
    with workdir(keep_logs) as root:
        console.log(f"logs in {root / 'logs'}")
        for round_ in range(rounds):
            for system in systems if round_ % 2 == 0 else systems[::-1]:
                runs.append(run_system(system, round_, args, tok, root, console))
    rows = summary(runs)
    table = Table(title=f"A returning chat's TTFT after its worker restarted or its model reloaded, through "
                        f"fleet serve, on {meta['cpu'] or 'an unnamed CPU'} ({meta['cores']} cores): {users} "
                        f"conversations, ~{tokens}-token histories, {rounds} round(s)")
    for col in ("system", "event", "TTFT p50 ms", "warm TTFT p50 ms", "x warm"):
        table.add_column(col, justify="left" if col in ("system", "event") else "right")
    for r in rows:
        table.add_row(r["system"], r["event"], f"{r['ttft_p50_ms']:.0f}", f"{r['warm_p50_ms']:.0f}",
                      f"{r['over_warm']:.2f}x")
    console.print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "config": args, "summary": rows, "runs": runs}, indent=1) + "\n")
    console.print(f"JSON: {out}")


if __name__ == "__main__":
    main()
