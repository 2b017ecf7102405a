"""`fleet bench --workload chat`: multi-turn chat, measured as users meet both sides: over HTTP,
streaming `/v1/chat/completions`, against `fleet serve` in front of the fleet and against
llama-server's own HTTP API (its defaults otherwise: context checkpoints, the host-RAM prompt
cache), same model, same chat template (llama.cpp's built-in gemma), same run, ABBA by round.

U users hold one conversation each: turn 1 is a 400-600-token document and a question, every later
turn resends the whole history (the answers as the server gave them: `real`; or each answer
edited by the client before it is resent, as chat UIs trim and reformat: `edited`) and asks a
new question. Later-turn TTFT is what a returning conversation costs.

With several workers, each is pinned to its share of the cores, and two more systems run: the
same fleet claiming blind to held prefixes (`placement: false`), and as many llama-servers,
pinned likewise, each user talking to server `user % N` (round robin over the users).

With `kv_store`, the fleet's workers share a KV store (a directory of the run), and the systems
are that fleet, the same fleet without a store, and the llama-servers: with fewer slots than
conversations and think times between turns, a returning conversation's holder is often busy,
and the other worker restores its history from the store (or, without one, prefills it).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from backends.model import default_model_path
from ecosystem.local.bench_chat_report import ChatRun, print_report, summarise, write_json
from ecosystem.local.bench_load import Sample, again_if_stale, http_client, streamed
from ecosystem.local.bench_report import percentile
from ecosystem.local.bench_setup import (
    core_shares,
    cpu_seconds,
    machine_meta,
    start_fleet_workers,
    with_children,
    workdir,
)
from ecosystem.local.bench_text import paragraph, question
from ecosystem.local.bench_workloads import Tokenizer, ctx_per_slot
from ecosystem.local.llama_server import llama_server_binary, start_llama_server
from ecosystem.local.processes import RedisServer, start_gateway, wait_until_healthy

FLEET, BLIND, STORE = "fleet serve", "fleet serve, claims blind to prefixes", "fleet serve, KV store"
HISTORIES = ("real", "edited")
CHAT_MAX_TOKENS = 64
# llama.cpp's built-in gemma template, as the fleet's: with jinja (llama-server's default)
# `--chat-template gemma` is read as a template text of its own and every chat renders "gemma"
SERVER_CHAT_ARGS = ("--no-jinja", "--chat-template", "gemma")
OPENING_PARAGRAPHS = 5  # 400-600 tokens
TURN_OVERHEAD_TOKENS = 24  # per turn: gemma's turn markers around a question and an answer, the edit
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class ChatConfig:
    users: int
    turns: int
    max_tokens: int
    histories: tuple[str, ...]
    workers: int
    threads: int
    rounds: int
    ctx_per_user: int  # least per-job context, raised to fit the longest conversation
    warmup: bool = True
    seed: int = 0
    server_args: tuple[str, ...] = ()  # more llama-server arguments, after SERVER_CHAT_ARGS
    fleet_settings: tuple[str, ...] = ()  # KEY=VALUE backend settings of the fleet's workers
    worker_settings: tuple[str, ...] = ()  # KEY=VALUE worker settings
    # slots of each fleet worker and each llama-server (0: the users, over the servers); fewer
    # than the conversations, returning ones find their KV only in a cache beyond the slots
    slots: int = 0
    think_ms: int = 0  # a user's pause before each later turn: uniform in [0, 2 x think_ms]
    kv_store: bool = False  # the fleet with a KV store beside the same fleet without one


def opening(seed: int, user: int, round_: int, history: str) -> str:
    """Turn 1: new for every user, round and history mode (never a cache hit of an earlier run)."""
    rng = random.Random(f"chat-{seed}-{round_}-{history}-{user}")
    doc = " ".join(paragraph(rng) for _ in range(OPENING_PARAGRAPHS))
    return f"Here are my notes:\n{doc}\n\n{question(rng)}"


def follow_ups(seed: int, user: int, round_: int, turns: int) -> list[str]:
    """The user's questions of turns 2.."""
    rng = random.Random(f"questions-{seed}-{round_}-{user}")
    return [question(rng) for _ in range(turns - 1)]


def edit(answer: str) -> str:
    """What a client may resend instead of the answer: reformatted from its first character."""
    return "Answer: " + answer.strip()


def context_needed(tok: Tokenizer, cfg: ChatConfig) -> int:
    """KV cells the longest conversation may need: its user turns, every answer at max_tokens,
    the template's markers."""
    most = 0
    for round_, history, user in itertools.product(range(cfg.rounds), cfg.histories, range(cfg.users)):
        texts = [opening(cfg.seed, user, round_, history), *follow_ups(cfg.seed, user, round_, cfg.turns)]
        most = max(most, sum(tok.count(t) for t in texts))
    return most + cfg.turns * (cfg.max_tokens + TURN_OVERHEAD_TOKENS)


class ChatClient:
    """Streaming chat completions to one server, shared by the users' threads."""

    def __init__(self, url: str, users: int, model: str = "llm") -> None:
        self.client = http_client(url, users)
        self.model = model

    def turn(self, messages: list[dict[str, str]], max_tokens: int, user: int) -> tuple[Sample, int, str]:
        """One streamed answer: (TTFT, e2e, completion tokens or the error), prompt tokens, text."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}, "user": f"user-{user}"}
        parts: list[str] = []
        usage: dict[str, int] = {}

        def read(chunk: dict[str, Any]) -> tuple[bool, int | None]:
            """Its content deltas kept (the answer is resent), usage noted (the end)."""
            texts = [t for c in chunk.get("choices") or [] if (t := (c.get("delta") or {}).get("content"))]
            parts.extend(texts)
            usage.update(chunk.get("usage") or {})
            return bool(texts), usage.get("completion_tokens")

        def send(t0: float) -> Sample:
            parts.clear()
            usage.clear()
            return streamed(self.client, "/v1/chat/completions", body, t0, read)

        try:
            sample = again_if_stale(send)
        except Exception as e:  # a broken turn is a data point, not the end of the run
            sample = Sample(None, 0.0, 0, f"{type(e).__name__}: {e}")
        return sample, int(usage.get("prompt_tokens", 0)), "".join(parts)

    def close(self) -> None:
        self.client.close()


def conversation(client: ChatClient, user: int, run: ChatRun, turns: int, max_tokens: int, seed: int,
                 lock: threading.Lock, think_ms: int = 0) -> None:
    messages = [{"role": "user", "content": opening(seed, user, run.round, run.history)}]
    questions = follow_ups(seed, user, run.round, turns)
    pauses = random.Random(f"think-{seed}-{run.round}-{user}")
    for turn in range(turns):
        if turn and think_ms:
            time.sleep(pauses.uniform(0, 2 * think_ms) / 1000)
        sample, prompt_tokens, answer = client.turn(messages, max_tokens, user)
        with lock:
            if sample.error is not None:
                run.errors.append(f"user {user} turn {turn + 1}: {sample.error}")
                return
            run.tokens += sample.tokens
            ttft_ms = (sample.ttft if sample.ttft is not None else sample.e2e) * 1000
            (run.ttft_later_ms if turn else run.ttft_first_ms).append(ttft_ms)
            run.first_prompt_tokens += 0 if turn else prompt_tokens
        if turn + 1 < turns:
            resent = edit(answer) if run.history == "edited" else answer
            messages += [{"role": "assistant", "content": resent},
                         {"role": "user", "content": questions[turn]}]


def measure(system: str, clients: Sequence[ChatClient], history: str, round_: int, users: int, turns: int,
            max_tokens: int, seed: int, pids: Mapping[str, Sequence[int]] | None = None,
            think_ms: int = 0) -> ChatRun:
    """Every user's conversation at once, user u on clients[u % len(clients)]; `pids`: the
    system's processes by group (workers, gateway, Redis), whose CPU time the run counts."""
    run = ChatRun(system, history, round_)
    lock = threading.Lock()
    start = threading.Barrier(users + 1)

    def user(u: int) -> None:
        start.wait()
        conversation(clients[u % len(clients)], u, run, turns, max_tokens, seed, lock, think_ms)

    threads = [threading.Thread(target=user, args=(u,), daemon=True, name=f"chat-{u}") for u in range(users)]
    for t in threads:
        t.start()
    start.wait()
    groups = pids or {}
    t0, cpu0 = time.perf_counter(), {name: cpu_seconds(ps) for name, ps in groups.items()}
    for t in threads:
        t.join()
    run.wall_s = time.perf_counter() - t0
    run.cpu_by = {name: round(cpu_seconds(ps) - cpu0[name], 2) for name, ps in groups.items()}
    run.cpu_s = sum(run.cpu_by.values())
    return run


class ChatBench:
    """One chat benchmark: starts every system, runs the rounds, stops it all on the way out."""

    def __init__(self, cfg: ChatConfig, console: Console, workdir: Path, tok: Tokenizer) -> None:
        self.cfg = cfg
        self.console = console
        self.workdir = workdir
        self.logs = workdir / "logs"
        self.tok = tok
        several = cfg.workers > 1
        self.peer = f"{cfg.workers} llama-servers, round robin" if several else "llama-server"
        fleets = [STORE, FLEET] if cfg.kv_store else [FLEET, *([BLIND] if several else [])]
        self.systems = [*fleets, self.peer]  # the peer last: ratios are over it
        self.per_slot = 0
        self.needed = 0
        self.pids: dict[str, dict[str, list[int]]] = {}  # each system's processes, by group

    def _context(self) -> int:
        self.needed = context_needed(self.tok, self.cfg)
        explicit = dict(kv.split("=", 1) for kv in self.cfg.fleet_settings).get("n_ctx_per_seq")
        per_slot = int(explicit) if explicit else ctx_per_slot(self.needed, self.cfg.ctx_per_user)
        self.console.log(f"chat: context {per_slot} tokens per conversation on both sides; the longest "
                         f"may need {self.needed}")
        return per_slot

    def _fleet(self, stack: contextlib.ExitStack, system: str) -> list[str]:
        cfg, placement = self.cfg, system != BLIND
        tag = {FLEET: "chat", BLIND: "chat-blind", STORE: "chat-store"}[system]
        redis = stack.enter_context(RedisServer.start(self.workdir / f"redis-{tag}"))
        slots = cfg.slots or cfg.users
        backend = {"type": "llama-cpp", "slots": slots, "n_ctx": slots * self.per_slot,
                   "n_ctx_per_seq": self.per_slot, "chat_template": "gemma",
                   **({"kv_store__path": str(self.workdir / "kv-store")} if system == STORE else {}),
                   **dict(kv.split("=", 1) for kv in cfg.fleet_settings)}
        settings = {**dict(kv.split("=", 1) for kv in cfg.worker_settings), "placement": placement}
        self.console.log(f"starting {cfg.workers} fleet worker(s), {slots} slots each, placement "
                         f"{'on' if placement else 'off'}, KV store {'on' if system == STORE else 'off'}, "
                         "and fleet serve")
        workers = start_fleet_workers(redis.url, f"bench-{tag}", self.logs, workers=cfg.workers,
                                      threads=cfg.threads, worker_settings=settings, backend=backend)
        for w in workers:
            stack.callback(w.stop)
        gw = start_gateway(redis.url, self.logs, name=f"gateway-{tag}")
        stack.callback(gw.stop)
        wait_until_healthy(gw, 60)
        self.pids[system] = {"redis": [redis.process.pid],
                                                    "gateway": with_children(gw.process.pid),
                                                    "workers": [w.process.pid for w in workers]}
        return [gw.url]

    def _servers(self, stack: contextlib.ExitStack) -> list[str]:
        cfg = self.cfg
        per_server = cfg.slots or -(-cfg.users // cfg.workers)
        args = (*SERVER_CHAT_ARGS, *cfg.server_args)
        urls = []
        for cores in core_shares(cfg.workers, cfg.threads) if cfg.workers > 1 else [[]]:
            threads = len(cores) or cfg.threads
            self.console.log(f"starting llama-server -np {per_server} -c {per_server * self.per_slot} "
                             f"-t {threads}", *args, f"(cores {cores})" if cores else "")
            srv = stack.enter_context(start_llama_server(self.logs, parallel=per_server,
                                                         ctx=per_server * self.per_slot, threads=threads,
                                                         extra_args=args, cpus=cores))
            urls.append(srv.url)
            self.pids.setdefault(self.peer, {}).setdefault("servers", []).append(srv.process.pid)
        return urls

    def run(self) -> list[ChatRun]:
        cfg = self.cfg
        runs: list[ChatRun] = []
        self.per_slot = self._context()
        with contextlib.ExitStack() as stack:
            urls = {name: self._fleet(stack, name) for name in self.systems if name != self.peer}
            urls[self.peer] = self._servers(stack)
            clients = {name: [ChatClient(u, cfg.users) for u in us] for name, us in urls.items()}
            for c in itertools.chain(*clients.values()):
                stack.callback(c.close)
            if cfg.warmup:  # every slot once, a few tokens: allocations off the clock
                for name in self.systems:
                    measure(name, clients[name], "warmup", -1, cfg.users, 1, WARMUP_TOKENS, cfg.seed)
            for round_, history in itertools.product(range(cfg.rounds), cfg.histories):
                order = self.systems if round_ % 2 == 0 else self.systems[::-1]
                for name in order:
                    run = measure(name, clients[name], history, round_, cfg.users, cfg.turns,
                                  cfg.max_tokens, cfg.seed, self.pids.get(name), cfg.think_ms)
                    runs.append(run)
                    self.console.log(f"round {round_} {history:6} {name}: {run.tok_s:.1f} tok/s, later-turn "
                                     f"TTFT p50 {percentile(run.ttft_later_ms, 50) or 0:.0f} ms"
                                     + (f", {len(run.errors)} errors" if run.errors else ""))
        return runs


def run_chat(cfg: ChatConfig, console: Console, out: Path, keep_logs: bool) -> dict[str, Any]:
    """The whole benchmark: run it, print the table, write the JSON; returns the summary."""
    meta: dict[str, Any] = {**machine_meta(), "config": asdict(cfg),
                            "llama_server": str(llama_server_binary()), "model": str(default_model_path())}
    started = time.monotonic()
    with workdir(keep_logs) as tmp:
        console.log(f"logs in {tmp / 'logs'}")
        chat = ChatBench(cfg, console, tmp, Tokenizer(default_model_path()))
        runs = chat.run()
    meta.update(ctx_per_slot=chat.per_slot, context_needed=chat.needed, systems=chat.systems,
                seconds=round(time.monotonic() - started, 1), loadavg_after=os.getloadavg())
    summary = summarise(runs, chat.systems, cfg.histories)
    title = (f"Multi-turn chat over HTTP on {meta['cpu'] or 'an unnamed CPU'}: {cfg.users} users x "
             f"{cfg.turns} turns, <= {cfg.max_tokens} tokens/answer, {cfg.workers} worker(s), "
             f"{cfg.rounds} round(s)")
    print_report(console, summary, chat.peer, title)
    write_json(out, meta, summary, runs)
    console.print(f"JSON: {out}")
    return summary
