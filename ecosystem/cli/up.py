"""`fleet up` and `fleet down`: the planned workers on this machine under supervisord."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from backends.contract.catalogue import model_pools
from backends.contract.connect import redis_from_url
from backends.contract.redact import redact_url
from backends.llamacpp_settings import kv_store_section
from ecosystem.autoscale import Autoscaler
from ecosystem.cli.ecosystem import make_plan, plan_options, plan_settings
from ecosystem.private_redis import RedisSetupError
from ecosystem.render import RenderOptions, default_command
from ecosystem.up import Interrupted, Launch, RunDir, UpError, down, supervisor_proxy
from worker.settings import FleetSettings

run_dir_option = click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Config, logs and private Redis data [default: $FLEET_RUN_DIR, else "
    "$XDG_STATE_HOME/llama-fleet/up, i.e. ~/.local/state/llama-fleet/up].",
)


def _run_dir(path: Path | None) -> RunDir:
    return RunDir(path.absolute()) if path else RunDir.default()


def _kv_store_env(settings: FleetSettings, run: RunDir) -> dict[str, str]:
    """The local fleet's KV store, in its run directory: for an engine that keeps per-slot KV
    (llama-cpp, not kv_unified) whose config names no store of its own."""
    cfg = kv_store_section(settings.backend)
    if cfg is None or cfg.path is not None:
        return {}
    return {"FLEET_BACKEND__KV_STORE__PATH": str(run.root / "kv-store")}


def _note(text: str) -> None:
    click.echo(f"fleet up: {text}", err=True)


@click.command("up")
@plan_options
@click.option("--daemon", is_flag=True, help="Return once every worker is up; stop with `fleet down`.")
@run_dir_option
@click.option(
    "--start-timeout",
    type=float,
    default=180.0,
    show_default=True,
    help="Seconds to wait for every worker to register.",
)
@click.option(
    "--redis-fsync",
    type=click.Choice(["everysec", "always"]),
    default="everysec",
    show_default=True,
    help="appendfsync of the private Redis: `always` loses no acknowledged enqueue in a crash "
    "(slower writes); everysec may lose the last second.",
)
@click.option("--scale-from-zero", is_flag=True, help="With a model catalogue: the workers start "
              "stopped; one starts when a model's queue has jobs and none serves it, and stops once "
              "it has held no model for --idle-stop seconds (`fleet autoscale`).")
@click.option("--kv-store", is_flag=True,
              help="The workers share a KV store in the run directory (kv-store/), unless the config "
              "names one: a returning chat restores its history after a restart, a reload, or on "
              "another worker instead of prefilling it; every long job's KV is copied and written "
              "(docs/conversations.md: what it gains and costs).")
@click.option("--idle-stop", type=click.FloatRange(0), default=60.0, show_default=True,
              help="With --scale-from-zero: seconds a worker without a model or job keeps running.")
def up_command(
    config: str | None,
    daemon: bool,
    run_dir: Path | None,
    start_timeout: float,
    redis_fsync: str,
    sysfs_root: Path | None,
    scale_from_zero: bool,
    kv_store: bool,
    idle_stop: float,
    **plan_args: Any,
) -> None:
    """Run the planned workers here under supervisord (and a private Redis when none answers at a
    local redis_url). Foreground: Ctrl-C or SIGTERM drains the workers and stops everything."""
    if sysfs_root is not None:
        raise click.BadParameter("fleet up places workers on this machine only", param_hint="--sysfs-root")
    settings, cfg = plan_settings(config)
    if scale_from_zero and not settings.catalogue_served():
        raise click.BadParameter("needs a model catalogue (`models`) the workers serve",
                                 param_hint="--scale-from-zero")
    autoscale = (("--idle-stop", str(idle_stop), *(("--config", str(cfg)) if cfg else ()))
                 if scale_from_zero else ())
    the_plan = make_plan(settings=settings, sysfs_root=None, **plan_args)
    run = _run_dir(run_dir)
    options = RenderOptions(
        command=default_command(),
        config_path=str(cfg) if cfg else None,
        cwd=str(Path.cwd()),
        drain_grace=settings.drain_grace,
        generated_by="fleet up",
        extra_env=_kv_store_env(settings, run) if kv_store else {},
    )
    try:
        launch = Launch.prepare(run, the_plan, options, settings.redis_url, redis_fsync, autoscale)
    except (UpError, RedisSetupError) as e:
        raise click.ClickException(str(e)) from None
    url = redact_url(settings.redis_url)
    if launch.private:
        _note(f"nothing answers at {url}: starting a private redis-server there (data in {run.redis_data})")
    launch.forward_signals(_note)
    launch.start(daemon)
    _note(f"supervisord pid {launch.process.pid if launch.process else '?'}, run dir {run.root}")
    try:
        rows = launch.wait_ready(start_timeout)
    except Interrupted:
        code = launch.wait()
        _note(f"stopped before the fleet was up (supervisord exit {code})")
        sys.exit(1)
    except UpError as e:
        launch.request_stop()
        launch.wait()
        raise click.ClickException(f"{e}\n(stopped everything it had started)") from None
    _show(rows, url, run)
    if daemon:
        _note(
            f"up in the background; `fleet down{'' if run_dir is None else ' --run-dir ' + str(run.root)}` "
            "stops it"
        )
        return
    _note("Ctrl-C or SIGTERM drains the workers and stops the fleet")
    code = launch.wait()
    left = launch.stop_leftovers()
    if left:
        raise click.ClickException(
            f"supervisord exited ({code}) and left {', '.join(left)} running: stopped them "
            "(workers drained first, then Redis)"
        )
    _note(f"stopped (supervisord exit {code}); logs in {run.root}")
    if code:
        sys.exit(code)


def _show(rows: list[dict[str, Any]], url: str, run: RunDir) -> None:
    table = Table(title=f"fleet up: {len(rows)} worker(s), redis {url}")
    for column in ("worker", "pid", "cpus", "node", "memory", "slots", "log"):
        table.add_column(column)
    for w in rows:
        table.add_row(
            str(w["name"]),
            str(w["pid"]),
            str(w.get("cpus") or "all"),
            str(w.get("numa_node") or "-"),
            str(w.get("numa_memory") or "-"),
            str(w.get("slots")),
            str(run.program_log(str(w["name"]))),
        )
    Console(stderr=True).print(table)


@click.command("down")
@run_dir_option
@click.option("--timeout", type=float, help="Seconds to wait for the drain [default: from the run's state].")
def down_command(run_dir: Path | None, timeout: float | None) -> None:
    """Stop a fleet started with `fleet up --daemon`: the workers drain, then everything stops."""
    run = _run_dir(run_dir)
    try:
        state = down(run, timeout)
    except UpError as e:
        raise click.ClickException(str(e)) from None
    if state is None:
        click.echo(f"fleet down: no fleet is up from {run.root}")
        return
    redis = " and the private Redis" if state.get("private_redis") else ""
    click.echo(
        f"fleet down: {len(state.get('workers', []))} worker(s){redis} stopped "
        f"(supervisord pid {state['pid']}); logs in {run.root}"
    )


@click.command("autoscale")
@click.option("--config", type=click.Path(dir_okay=False), help="worker-config.json")
@click.option("--supervisor-socket", type=click.Path(path_type=Path), required=True,
              help="the unix socket of the supervisord running the workers")
@click.option("--idle-stop", type=click.FloatRange(0), default=60.0, show_default=True,
              help="seconds a worker without a model or job keeps running")
@click.option("--interval", type=click.FloatRange(0.1, 60), default=1.0, show_default=True)
def autoscale_command(config: str | None, supervisor_socket: Path, idle_stop: float, interval: float) -> None:
    """Start and stop `fleet up --scale-from-zero`'s workers by the catalogue models' queues
    (supervisord runs it beside them)."""
    settings, _ = plan_settings(config)
    pools = model_pools(settings.models)
    served = [pools[m] for m in settings.catalogue_served()]
    _note(f"autoscale: {len(served)} model pool(s), idle stop {idle_stop:g}s")
    Autoscaler(redis_from_url(settings.redis_url), supervisor_proxy(supervisor_socket), served,
               idle_stop).run(interval)


def register(cli: click.Group) -> None:
    for command in (up_command, down_command, autoscale_command):
        cli.add_command(command)
