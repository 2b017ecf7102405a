"""`fleet bench` (also `scripts/bench`): the fleet against llama-server, in ONE run, same machine.

It starts a private redis-server and a fleet (by default one worker on the in-process llama.cpp
backend, threads = cores, slots = the largest user count), and for every user count C a real
`llama-server -np C -t <threads> -c <C * ctx-per-user>` on the same model. C closed-loop users
then run the same greedy requests (same prompts, same max_tokens) through the fleet (Fleet.submit
+ the job's stream) and directly against llama-server (`/completion` SSE, the body the
llama-server backend sends). The two systems alternate (which goes first flips per level and per
round) so machine noise falls on both.

`--fleet-backend llama-server`: the fleet's worker uses the llama-server backend on that same
server, so the comparison is fleet-in-front-of-llama-server vs direct clients.

`--via http`: the bench also starts `fleet serve` on its Redis, and one client drives both sides
with the same body: OpenAI's `/v1/completions`, streamed (ecosystem/local/bench_load.py).

Prints a table (users, system, tok/s, ratio fleet/peer, TTFT and end-to-end p50/p95, CPU seconds
per 1k tokens by process group) and writes JSON (and a PNG when matplotlib is installed).

`--workload chat` measures multi-turn conversations over HTTP instead (`fleet serve` against
llama-server's own API): ecosystem/local/bench_chat.py.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import psutil
from click.core import ParameterSource
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from backends.model import default_model_path
from ecosystem.local.bench_chat import CHAT_MAX_TOKENS, HISTORIES, ChatConfig, run_chat
from ecosystem.local.bench_html import write_html
from ecosystem.local.bench_load import (
    CompletionsTarget,
    FleetTarget,
    LlamaServerTarget,
    Sample,
    Target,
    closed_loop,
)
from ecosystem.local.bench_report import FLEET, PEER, Run, print_report, summaries, write_json, write_plot
from ecosystem.local.bench_setup import cpu_seconds, machine_meta, start_fleet_workers, with_children, workdir
from ecosystem.local.bench_stalls import StallsConfig, run_stalls
from ecosystem.local.bench_workloads import (
    WORKLOADS,
    BenchRequest,
    Tokenizer,
    Workload,
    context_needed,
    ctx_per_slot,
    describe,
    with_max_tokens,
)
from ecosystem.local.llama_server import LlamaServer, llama_server_binary, start_llama_server
from ecosystem.local.processes import (
    GatewayProcess,
    RedisServer,
    WorkerProcess,
    start_gateway,
    wait_until_healthy,
)

CHAT = "chat"  # multi-turn conversations over HTTP: ecosystem/local/bench_chat.py
CHAT_USERS = 4  # --users unless given
STALLS = "stalls"  # running streams while long prompts prefill: ecosystem/local/bench_stalls.py
ALONE = (CHAT, STALLS)  # workloads with their own systems and table

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, step by step.",
    "List five surprising facts about octopuses and explain each one.",
    "Describe a busy market in a small coastal town at sunrise.",
    "What are the main differences between a comet and an asteroid?",
    "Write a letter from a young dragon to its grandmother.",
    "Give practical advice for someone learning to cook at home.",
    "Tell the story of a robot that wants to become a gardener.",
    "Why do leaves change colour in autumn? Explain it simply.",
    "Write a poem about the first snow of winter in a big city.",
    "Describe how bread is made, from the field to the bakery.",
    "Invent a new board game and explain its rules.",
    "Summarise the life cycle of a star in a few paragraphs.",
    "Write a dialogue between a cat and a dog about their owner.",
    "Explain what makes a good friend, with examples.",
    "Describe a journey by train across snowy mountains.",
]


@dataclass
class BenchConfig:
    users: list[int]
    requests_per_user: int
    max_tokens: int | None  # None: each workload's own output lengths; else a cap on them
    prompts: list[str]
    fleet_backend: str  # "llama-cpp" | "llama-server"
    workers: int
    threads: int
    ctx_per_user: int
    rounds: int
    warmup: bool
    server_args: tuple[str, ...] = ()
    fleet_settings: tuple[str, ...] = ()  # KEY=VALUE backend settings for the fleet's workers
    worker_settings: tuple[str, ...] = ()  # KEY=VALUE worker settings (e.g. observe=false)
    workloads: tuple[str, ...] = ("short",)
    seed: int = 0
    via: str = "api"  # "api": Fleet.submit vs llama-server's /completion; "http": /v1/completions on both
    kv_store: bool = False  # the fleet's workers with a KV store (a directory of this run)


class Bench:
    """One benchmark run: owns every process it starts, stops them all on the way out."""

    def __init__(self, cfg: BenchConfig, console: Console, workdir: Path) -> None:
        self.cfg = cfg
        self.console = console
        self.logs = workdir / "logs"
        self.workdir = workdir
        self.runs: list[Run] = []
        self.me = psutil.Process()
        self.tokenizer = Tokenizer(default_model_path())
        self.short = Workload("short", self.tokenizer, short_prompts=cfg.prompts)  # the warm-up's
        self.workload_meta: dict[str, dict[str, Any]] = {}  # per workload: lengths, context sizes

    # -- processes --------------------------------------------------------------------------------

    def _start_workers(self, redis_url: str, tag: str, **backend: Any) -> list[WorkerProcess]:
        """`workers` fleet workers; with several, each pinned to its share of the cores."""
        settings = dict(kv.split("=", 1) for kv in self.cfg.worker_settings)
        return start_fleet_workers(redis_url, f"bench-{tag}", self.logs, workers=self.cfg.workers,
                                   threads=self.cfg.threads, worker_settings=settings, backend=backend)

    def _slots(self) -> int:
        return -(-max(self.cfg.users) // self.cfg.workers)

    def _llama_cpp_fleet(self, redis_url: str, per_slot: int, workload: str) -> list[WorkerProcess]:
        slots = self._slots()
        self.console.log(f"starting {self.cfg.workers} fleet worker(s): llama-cpp, {slots} slots, "
                         f"{self.cfg.threads} threads, n_ctx_per_seq={per_slot}")
        extra = dict(kv.split("=", 1) for kv in self.cfg.fleet_settings)
        if self.cfg.kv_store:
            extra.setdefault("kv_store__path", str(self.workdir / f"kv-store-{workload}"))
        return self._start_workers(redis_url, f"cpp-{workload}", **{"type": "llama-cpp", "slots": slots,
                                   "n_ctx": slots * per_slot, "n_ctx_per_seq": per_slot, **extra})

    def _per_slot(self, workload: Workload) -> int:
        """The context of one job on both sides: `--fleet-set n_ctx_per_seq=N` if given (too small a
        value shows as jobs rejected for length), else the longest request rounded up to a power
        of two, at least --ctx-per-user. llama-server gets -c users x this, so -np C slots of it."""
        cfg = self.cfg
        every = workload.requests(0, cfg.rounds * max(cfg.users) * cfg.requests_per_user)
        needed = context_needed(every)
        explicit = dict(kv.split("=", 1) for kv in cfg.fleet_settings).get("n_ctx_per_seq")
        per_slot = int(explicit) if explicit else ctx_per_slot(needed, cfg.ctx_per_user)
        fleet = (f"fleet n_ctx_per_seq={per_slot} x {self._slots()} slots"
                 if cfg.fleet_backend == "llama-cpp" else "the fleet fronts that llama-server")
        self.console.log(f"workload {workload.name}: context {per_slot} tokens per job on both sides "
                         f"({fleet}; llama-server -np C -c C x {per_slot}); "
                         f"the longest request needs {needed}")
        self.workload_meta[workload.name] = {**describe(every), "context_needed": needed,
                                             "ctx_per_slot": per_slot}
        return per_slot

    def _server(self, users: int, per_slot: int) -> LlamaServer:
        ctx = users * per_slot
        extra = self.cfg.server_args
        self.console.log(f"starting llama-server -np {users} -c {ctx} -t {self.cfg.threads}", *extra)
        return start_llama_server(self.logs, parallel=users, ctx=ctx, threads=self.cfg.threads,
                                  extra_args=extra)

    # -- measuring --------------------------------------------------------------------------------

    def _cpu(self, groups: dict[str, list[int]]) -> dict[str, float]:
        return {name: cpu_seconds(pids) for name, pids in groups.items()}

    def _measure(self, progress: Progress, workload: str, users: int, role: str, system: str, round_: int,
                 target: Target, groups: dict[str, list[int]], requests: list[BenchRequest]) -> None:
        cfg = self.cfg
        task = progress.add_task(f"{workload:<13} {users:>3} users  {system}",
                                 total=users * cfg.requests_per_user)
        before = self._cpu(groups)

        def tick(_s: Sample) -> None:
            progress.advance(task)

        load = closed_loop(target, users, cfg.requests_per_user, requests, tick)
        after = self._cpu(groups)
        cpu = {k: round(after[k] - before[k], 3) for k in groups}
        self.runs.append(Run.of(users, role, system, round_, load, cpu, workload))

    def _level(self, progress: Progress, index: int, users: int, redis: RedisServer,
               fleet_workers: list[WorkerProcess], workload: Workload, per_slot: int,
               gateway: GatewayProcess | None) -> None:
        cfg = self.cfg
        with contextlib.ExitStack() as stack:
            server = stack.enter_context(self._server(users, per_slot))
            workers = fleet_workers
            if cfg.fleet_backend == "llama-server":
                workers = self._start_workers(redis.url, f"srv{users}", type="llama-server",
                                              endpoint=server.url)
                for w in workers:
                    stack.callback(w.stop)
            peer: LlamaServerTarget | CompletionsTarget
            fleet: FleetTarget | CompletionsTarget
            me, rs, srv = [self.me.pid], [redis.process.pid], [server.process.pid]
            fleet_pids = {"worker": [w.process.pid for w in workers], "redis": rs, "client": me}
            if gateway is None:
                peer, fleet = LlamaServerTarget(server.url, users), FleetTarget(redis.url)
            else:
                wait_until_healthy(gateway, 60)  # its view of the workers is fresh
                peer = CompletionsTarget.llama_server(server.url, users, seed=cfg.seed)
                fleet = CompletionsTarget(gateway.url, users, seed=cfg.seed)
                stack.callback(fleet.close)
                fleet_pids["gateway"] = with_children(gateway.process.pid)
            stack.callback(peer.close)
            entry = "fleet" if gateway is None else "fleet serve"
            if cfg.fleet_backend == "llama-server":
                fleet_pids["llama-server"] = srv
                names = {FLEET: f"{entry} -> llama-server", PEER: "direct -> llama-server"}
            else:
                names = {FLEET: f"{entry} (llama-cpp)", PEER: f"llama-server -np {users}"}
            plan: dict[str, tuple[Target, dict[str, list[int]]]] = {
                FLEET: (fleet, fleet_pids), PEER: (peer, {"llama-server": srv, "client": me})}
            if cfg.warmup:  # every slot once, short prompts, a few tokens: allocations off the clock
                for target, _ in plan.values():
                    closed_loop(target, users, 1, with_max_tokens(self.short.requests(0, users), 8))
            n = users * cfg.requests_per_user
            for rnd in range(cfg.rounds):  # each round its own requests, the same on both sides
                requests = workload.requests(rnd * n, n)
                order = [FLEET, PEER] if (index + rnd) % 2 == 0 else [PEER, FLEET]
                for role in order:
                    target, groups = plan[role]
                    self._measure(progress, workload.name, users, role, names[role], rnd, target, groups,
                                  requests)

    def run(self) -> list[Run]:
        with contextlib.ExitStack() as stack:
            redis = stack.enter_context(RedisServer.start(self.workdir / "redis"))
            gateway = None
            if self.cfg.via == "http":
                self.console.log("starting fleet serve (the gateway) on the bench's Redis")
                gateway = start_gateway(redis.url, self.logs, name="bench-gateway")
                stack.callback(gateway.stop)
            progress = stack.enter_context(Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=self.console))
            for name in self.cfg.workloads:
                workload = Workload(name, self.tokenizer, seed=self.cfg.seed, max_tokens=self.cfg.max_tokens,
                                    short_prompts=self.cfg.prompts)
                per_slot = self._per_slot(workload)
                with contextlib.ExitStack() as fleet:  # sized for this workload's context
                    fleet_workers: list[WorkerProcess] = []
                    if self.cfg.fleet_backend == "llama-cpp":
                        fleet_workers = self._llama_cpp_fleet(redis.url, per_slot, name)
                        for w in fleet_workers:
                            fleet.callback(w.stop)
                    for i, users in enumerate(self.cfg.users):
                        self._level(progress, i, users, redis, fleet_workers, workload, per_slot, gateway)
        return self.runs


# -- the command -------------------------------------------------------------------------------------


def _user_counts(_ctx: click.Context, _param: click.Parameter, value: str) -> list[int]:
    try:
        counts = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected e.g. 1,4,16,32, not {value!r}") from None
    if not counts or min(counts) < 1:
        raise click.BadParameter("user counts must be positive")
    return counts


def _workloads(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(x.strip() for x in value.split(",") if x.strip()))
    unknown = [n for n in names if n not in (*WORKLOADS, *ALONE)]
    if unknown or not names:
        raise click.BadParameter(f"unknown workload {', '.join(unknown) or repr(value)}; choose from "
                                 f"{', '.join(WORKLOADS)} (a comma list runs each), {CHAT} or {STALLS}")
    alone = [n for n in names if n in ALONE]
    if alone and len(names) > 1:
        raise click.BadParameter(f"{alone[0]} runs alone (it has its own systems and table)")
    return names


def _given(name: str) -> bool:
    return click.get_current_context().get_parameter_source(name) is not ParameterSource.DEFAULT


def _refuse(options: dict[str, str], why: str) -> None:
    """A usage error for the first of these options (parameter name -> flag) given on the line."""
    for name, flag in options.items():
        if _given(name):
            raise click.UsageError(f"{flag} {why}")


def _warn_if_busy(console: Console) -> None:
    load, cores = os.getloadavg()[0], len(os.sched_getaffinity(0))
    if load > 0.5 * cores:
        console.print(f"[yellow]load average {load:.2f} on {cores} cores: "
                      "other work is running, the numbers will be noisy")


@click.command("bench")
@click.option("--users", default="1,4,16,32", callback=_user_counts, show_default=True,
              help=f"closed-loop user counts, one level each ({CHAT}: one count, default {CHAT_USERS})")
@click.option("--workload", "workloads", default="short", callback=_workloads, show_default=True,
              help=f"{', '.join(WORKLOADS)}, or a comma list (docs/bench.md says what each sends); "
                   f"or {CHAT}: multi-turn conversations over HTTP (--turns, --history); or {STALLS}: "
                   "the longest gap of running streams while two 3,000-token prompts prefill")
@click.option("--seed", type=int, default=0, show_default=True, help="the workloads' requests come from it")
@click.option("--requests-per-user", type=click.IntRange(1), default=2, show_default=True)
@click.option("--max-tokens", type=click.IntRange(1, 4096), default=None,
              help="cap on output tokens (default: the workload's own: short 64, mixed 16-256, "
                   "shared-prefix 64, grounded 256, chat 64)")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="the short workload's prompts, one a line (default: 16 built-in ones)")
@click.option("--fleet-backend", type=click.Choice(["llama-cpp", "llama-server"]), default="llama-cpp",
              show_default=True, help="llama-server: the fleet worker fronts the same llama-server")
@click.option("--workers", type=click.IntRange(1), default=1, show_default=True,
              help=f"fleet workers, each pinned to its share of the cores when several ({CHAT}: as many "
                   "llama-servers, and the same fleet claiming blind to prefixes)")
@click.option("--via", type=click.Choice(["api", "http"]), default="api", show_default=True,
              help="api: the fleet's Python API vs llama-server's /completion; http: fleet serve vs "
                   "llama-server, both over OpenAI's /v1/completions (streamed, same body)")
@click.option("--threads", type=click.IntRange(1), default=None, help="default: the cores we may run on")
@click.option("--ctx-per-user", type=click.IntRange(64), default=512, show_default=True,
              help="least KV cells per job, raised to fit the workload's longest request "
                   "(fleet n_ctx_per_seq; llama-server -c = users x this)")
@click.option("--rounds", type=click.IntRange(1), default=1, show_default=True,
              help="repeat each level, flipping which system goes first")
@click.option("--warmup/--no-warmup", default=True, show_default=True)
@click.option("--server-arg", "server_args", multiple=True,
              help="extra llama-server argument (repeatable), e.g. --server-arg=--kv-unified")
@click.option("--fleet-set", "fleet_settings", multiple=True, callback=lambda _c, _p, v: _key_values(v),
              help="backend setting of the fleet's llama-cpp workers (repeatable), "
                   "e.g. --fleet-set batch_invariant=true")
@click.option("--worker-set", "worker_settings", multiple=True, callback=lambda _c, _p, v: _key_values(v),
              help="worker setting of the fleet's workers (repeatable), e.g. --worker-set observe=false")
@click.option("--turns", type=click.IntRange(1), default=5, show_default=True,
              help="chat: turns per conversation")
@click.option("--slots", type=click.IntRange(0), default=0, show_default=True,
              help="chat: slots of each fleet worker and llama-server (0: as many as users); fewer "
                   "than --users: conversations find their KV only in a cache beyond the slots")
@click.option("--think-ms", type=click.IntRange(0), default=0, show_default=True,
              help="chat: a user's pause before each later turn, uniform in [0, 2 x this] ms")
@click.option("--kv-store", is_flag=True,
              help="the fleet's workers share a KV store (a directory of the run); chat: that fleet beside "
                   "the same fleet without one")
@click.option("--history", type=click.Choice(["real", "edited", "both"]), default="both", show_default=True,
              help="chat: resend each answer as given (real), reformatted by the client (edited), or both")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="JSON file (default ./bench-results/fleet-bench-<time>.json); a .png beside it")
@click.option("--keep-logs", is_flag=True, help="keep the worker/server logs of a good run too")
def bench(users: list[int], workloads: tuple[str, ...], seed: int, requests_per_user: int,
          max_tokens: int | None, prompts_file: str | None,
          fleet_backend: str, workers: int, via: str, threads: int | None, ctx_per_user: int, rounds: int,
          warmup: bool, server_args: tuple[str, ...], fleet_settings: tuple[str, ...],
          worker_settings: tuple[str, ...], turns: int, slots: int, think_ms: int, kv_store: bool,
          history: str, out: Path | None, keep_logs: bool) -> None:
    """Benchmark the fleet against llama-server -np C on the same model and machine, in one run."""
    console = Console()
    if not console.is_terminal:  # a log file: no need to squeeze the table into 80 columns
        console = Console(width=150)
    per_seq = dict(kv.split("=", 1) for kv in fleet_settings).get("n_ctx_per_seq")
    if per_seq is not None and not per_seq.isdigit():
        raise click.BadParameter(f"n_ctx_per_seq={per_seq!r} is not a token count", param_hint="--fleet-set")
    threads = threads or len(os.sched_getaffinity(0))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if workloads == (STALLS,):
        _refuse({"requests_per_user": "--requests-per-user", "prompts_file": "--prompts",
                 "fleet_backend": "--fleet-backend", "via": "--via", "turns": "--turns",
                 "history": "--history", "slots": "--slots", "workers": "--workers", "think_ms": "--think-ms",
                 "kv_store": "--kv-store"},
                f"does not apply to --workload {STALLS}")
        if _given("users") and len(users) > 1:
            raise click.BadParameter(f"--workload {STALLS} takes one user count", param_hint="--users")
        stalls = StallsConfig(users=users[0] if _given("users") else CHAT_USERS,
                              stream_tokens=max_tokens or StallsConfig.stream_tokens, rounds=rounds,
                              threads=threads, seed=seed, fleet_settings=fleet_settings)
        _warn_if_busy(console)
        run_stalls(stalls, console, out or Path("bench-results") / f"fleet-bench-stalls-{stamp}.json",
                   keep_logs)
        return
    if workloads == (CHAT,):
        _refuse({"requests_per_user": "--requests-per-user", "prompts_file": "--prompts",
                 "fleet_backend": "--fleet-backend", "via": "--via"},
                f"does not apply to --workload {CHAT} (always over HTTP)")
        if _given("users") and len(users) > 1:
            raise click.BadParameter(f"--workload {CHAT} takes one user count", param_hint="--users")
        chat = ChatConfig(users[0] if _given("users") else CHAT_USERS, turns, max_tokens or CHAT_MAX_TOKENS,
                          HISTORIES if history == "both" else (history,), workers, threads, rounds,
                          ctx_per_user, warmup, seed, server_args, fleet_settings, worker_settings, slots,
                          think_ms, kv_store)
        _warn_if_busy(console)
        run_chat(chat, console, out or Path("bench-results") / f"fleet-bench-chat-{stamp}.json", keep_logs)
        return
    _refuse({"turns": "--turns", "history": "--history", "slots": "--slots", "think_ms": "--think-ms"},
            f"applies to --workload {CHAT} only")
    prompts = PROMPTS
    if prompts_file:
        prompts = [ln.strip() for ln in Path(prompts_file).read_text().splitlines() if ln.strip()]
        if not prompts:
            raise click.BadParameter("the prompts file has no prompts", param_hint="--prompts")
    cfg = BenchConfig(users, requests_per_user, max_tokens, prompts, fleet_backend, workers, threads,
                      ctx_per_user, rounds, warmup, server_args, fleet_settings, worker_settings, workloads,
                      seed, via, kv_store)
    config = {k: v for k, v in vars(cfg).items() if k != "prompts"}
    meta: dict[str, Any] = {**machine_meta(), "via": via, "config": config, "prompts": len(prompts),
                            "llama_server": str(llama_server_binary()), "model": str(default_model_path())}
    _warn_if_busy(console)
    out = out or Path("bench-results") / f"fleet-bench-{stamp}.json"
    started = time.monotonic()
    with workdir(keep_logs) as tmp:
        console.log(f"logs in {tmp / 'logs'}")
        bench_run = Bench(cfg, console, tmp)
        runs = bench_run.run()
    meta["workloads"] = bench_run.workload_meta
    meta["seconds"] = round(time.monotonic() - started, 1)
    meta["loadavg_after"] = os.getloadavg()
    rows = summaries(runs)
    outputs = "each workload's output lengths" if max_tokens is None else f"<= {max_tokens} tokens/request"
    driven = ("via the Python API and llama-server's /completion" if via == "api"
              else "via HTTP: /v1/completions on fleet serve and on llama-server")
    title = (f"fleet bench on {meta['cpu'] or 'an unnamed CPU'} ({cfg.threads} threads): {outputs}, "
             f"{requests_per_user} requests/user, fleet backend {fleet_backend}, {driven}")
    print_report(console, rows, title)
    write_json(out, meta, runs, rows)
    console.print(f"JSON: {out}")
    if write_plot(out.with_suffix(".png"), rows, title):
        console.print(f"plot: {out.with_suffix('.png')}")
    write_html(out.with_suffix(".html"), rows, title, meta, png=out.with_suffix(".png"))
    console.print(f"HTML report: {out.with_suffix('.html')}")


def _key_values(values: tuple[str, ...]) -> tuple[str, ...]:
    for kv in values:
        if "=" not in kv or not kv.split("=", 1)[0]:
            raise click.BadParameter(f"{kv!r} is not KEY=VALUE", param_hint="--fleet-set")
    return values


def register(cli: click.Group) -> None:
    cli.add_command(bench)

if __name__ == "__main__":
    bench()
