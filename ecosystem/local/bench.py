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
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import psutil
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from backends.model import default_model_path
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
from ecosystem.local.gateway import GatewayProcess, start_gateway, wait_until_healthy
from ecosystem.local.llama_server import LlamaServer, llama_server_binary, start_llama_server
from ecosystem.local.processes import RedisServer, WorkerProcess, start_worker
from worker.settings import format_cpu_list

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
        n = self.cfg.workers
        cores = sorted(os.sched_getaffinity(0))
        per = max(1, self.cfg.threads // n)
        started = []
        for i in range(n):
            extra: dict[str, Any] = {f"backend__{k}": v for k, v in backend.items()}
            extra.update(kv.partition("=")[::2] for kv in self.cfg.worker_settings)
            if n > 1:
                extra["cpus"] = format_cpu_list(cores[i * per:(i + 1) * per] or cores)
            if backend.get("type") == "llama-cpp":  # another engine refuses a thread count
                extra.setdefault("backend__threads", per)
            started.append(start_worker(redis_url, f"bench-{tag}-{i}", self.logs, timeout=180, **extra))
        return started

    def _slots(self) -> int:
        return -(-max(self.cfg.users) // self.cfg.workers)

    def _llama_cpp_fleet(self, redis_url: str, per_slot: int, workload: str) -> list[WorkerProcess]:
        slots = self._slots()
        self.console.log(f"starting {self.cfg.workers} fleet worker(s): llama-cpp, {slots} slots, "
                         f"{self.cfg.threads} threads, n_ctx_per_seq={per_slot}")
        extra = dict(kv.split("=", 1) for kv in self.cfg.fleet_settings)
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
        out = {}
        for name, pids in groups.items():
            total = 0.0
            for pid in pids:
                with contextlib.suppress(psutil.Error):
                    t = psutil.Process(pid).cpu_times()
                    total += t.user + t.system
            out[name] = total
        return out

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
                fleet_pids["gateway"] = _with_children(gateway.process.pid)
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


def _with_children(pid: int) -> list[int]:
    """A process and its children (`fleet serve` with gateway.workers > 1 forks them)."""
    with contextlib.suppress(psutil.Error):
        return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    return [pid]


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
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise click.BadParameter(f"unknown workload {', '.join(unknown) or repr(value)}; "
                                 f"choose from {', '.join(WORKLOADS)} (a comma list runs each)")
    return names


def machine_meta() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("model name")), "")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    return {"cores": len(os.sched_getaffinity(0)), "cpu": model, "loadavg": os.getloadavg(),
            "commit": commit, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


@contextlib.contextmanager
def workdir(keep: bool) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    ok = False
    try:
        yield path
        ok = True
    finally:
        if ok and not keep:
            shutil.rmtree(path, ignore_errors=True)


@click.command("bench")
@click.option("--users", default="1,4,16,32", callback=_user_counts, show_default=True,
              help="closed-loop user counts, one level each")
@click.option("--workload", "workloads", default="short", callback=_workloads, show_default=True,
              help=f"{', '.join(WORKLOADS)}, or a comma list (docs/bench.md says what each sends)")
@click.option("--seed", type=int, default=0, show_default=True, help="the workloads' requests come from it")
@click.option("--requests-per-user", type=click.IntRange(1), default=2, show_default=True)
@click.option("--max-tokens", type=click.IntRange(1, 4096), default=None,
              help="cap on output tokens (default: the workload's own: short 64, mixed 16-256, "
                   "shared-prefix 64, grounded 256)")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="the short workload's prompts, one a line (default: 16 built-in ones)")
@click.option("--fleet-backend", type=click.Choice(["llama-cpp", "llama-server"]), default="llama-cpp",
              show_default=True, help="llama-server: the fleet worker fronts the same llama-server")
@click.option("--workers", type=click.IntRange(1), default=1, show_default=True)
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
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="JSON file (default ./bench-results/fleet-bench-<time>.json); a .png beside it")
@click.option("--keep-logs", is_flag=True, help="keep the worker/server logs of a good run too")
def bench(users: list[int], workloads: tuple[str, ...], seed: int, requests_per_user: int,
          max_tokens: int | None, prompts_file: str | None,
          fleet_backend: str, workers: int, via: str, threads: int | None, ctx_per_user: int, rounds: int,
          warmup: bool, server_args: tuple[str, ...], fleet_settings: tuple[str, ...],
          worker_settings: tuple[str, ...], out: Path | None, keep_logs: bool) -> None:
    """Benchmark the fleet against llama-server -np C on the same model and machine, in one run."""
    console = Console()
    if not console.is_terminal:  # a log file: no need to squeeze the table into 80 columns
        console = Console(width=150)
    prompts = PROMPTS
    if prompts_file:
        prompts = [ln.strip() for ln in Path(prompts_file).read_text().splitlines() if ln.strip()]
        if not prompts:
            raise click.BadParameter("the prompts file has no prompts", param_hint="--prompts")
    cfg = BenchConfig(users, requests_per_user, max_tokens, prompts, fleet_backend, workers,
                      threads or len(os.sched_getaffinity(0)), ctx_per_user, rounds, warmup, server_args,
                      fleet_settings, worker_settings, workloads, seed, via)
    config = {k: v for k, v in vars(cfg).items() if k != "prompts"}
    per_seq = dict(kv.split("=", 1) for kv in fleet_settings).get("n_ctx_per_seq")
    if per_seq is not None and not per_seq.isdigit():
        raise click.BadParameter(f"n_ctx_per_seq={per_seq!r} is not a token count", param_hint="--fleet-set")
    meta: dict[str, Any] = {**machine_meta(), "via": via, "config": config, "prompts": len(prompts),
                            "llama_server": str(llama_server_binary()), "model": str(default_model_path())}
    if meta["loadavg"][0] > 0.5 * meta["cores"]:
        console.print(f"[yellow]load average {meta['loadavg'][0]:.2f} on {meta['cores']} cores: "
                      "other work is running, the numbers will be noisy")
    stamp = time.strftime("%Y%m%d-%H%M%S")
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
