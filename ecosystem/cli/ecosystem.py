"""Placement: `fleet plan` and `fleet ecosystem` (PM2, supervisord, systemd or Kubernetes), and the
plan options that `fleet up` shares."""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import click
from pydantic import ValidationError

from ecosystem.cli.kubernetes import kubernetes_options, write_kubernetes
from ecosystem.cli.options import config_option, json_option
from ecosystem.planner import Plan, PlanError, Workers, plan
from ecosystem.render import FORMATS, Format, RenderOptions, default_command, render
from ecosystem.topology import read_topology
from worker.settings import FleetSettings, SettingsError, config_path, load_settings

F = TypeVar("F", bound=Callable[..., Any])
K8S_ARGS = ("image", "namespace", "memory_mib", "ttft_target", "tokens_per_s", "min_workers", "max_workers")


class WorkersParam(click.ParamType):
    name = "N|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Workers:
        if isinstance(value, int) or value == "auto":
            return value
        try:
            n = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is neither a number nor 'auto'", param, ctx)
        if n < 1:
            self.fail(f"{n} workers: need at least 1", param, ctx)
        return n


def plan_options(func: F) -> F:
    options = [
        click.option(
            "--workers",
            type=WorkersParam(),
            default="auto",
            show_default=True,
            help="Worker count, or 'auto': one per NUMA node (or as many as fit --cores-per-worker).",
        ),
        click.option("--cores-per-worker", type=click.IntRange(min=1), help="Physical cores per worker."),
        click.option(
            "--slots",
            type=click.IntRange(min=1),
            help="Sequences per worker context [default: backend.slots of the config, else 16].",
        ),
        click.option(
            "--reserve-cores",
            type=click.IntRange(min=0),
            default=0,
            show_default=True,
            help="Physical cores kept free at the end of node 0 (Redis, the OS).",
        ),
        click.option("--smt/--no-smt", default=False, help="Also give workers their cores' SMT siblings."),
        click.option("--name-prefix", default="worker", show_default=True, help="Workers are PREFIX-0, ..."),
        click.option(
            "--sysfs-root",
            type=click.Path(file_okay=False, path_type=Path),
            help="Read topology from a recorded sysfs tree instead of this machine's /sys.",
        ),
        config_option(may_be_absent=True),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def plan_settings(config: str | None) -> tuple[FleetSettings, Path | None]:
    """The settings the workers will read (for slots and drain grace) and the config's path.
    A config that does not exist here (rendering for another host) gives defaults and a warning."""
    path = config_path(config)
    if path is not None:
        path = path.absolute()
    try:
        if path is not None and not path.exists():
            click.echo(f"note: {path} not found here; slots and drain grace from defaults/env", err=True)
            no_file: dict[str, Any] = {}  # env and defaults only (spelled so for mypy without the plugin)
            return FleetSettings(**no_file), path
        return load_settings(path), path
    except (SettingsError, ValidationError) as e:
        raise click.ClickException(str(e)) from None


def make_plan(
    workers: Workers,
    cores_per_worker: int | None,
    slots: int | None,
    reserve_cores: int,
    smt: bool,
    name_prefix: str,
    sysfs_root: Path | None,
    settings: FleetSettings,
) -> Plan:
    # The live machine: only the CPUs this process may use (container cpusets).
    topology = (
        read_topology(sysfs_root) if sysfs_root else read_topology("/sys", allowed=os.sched_getaffinity(0))
    )
    try:
        return plan(
            topology,
            workers=workers,
            cores_per_worker=cores_per_worker,
            slots=slots if slots is not None else settings.backend.slots,
            reserve_cores=reserve_cores,
            smt=smt,
            name_prefix=name_prefix,
            engine_threads=settings.backend.type == "llama-cpp",
        )
    except PlanError as e:
        raise click.ClickException(f"{e} [{topology.summary()}]") from None


@click.command("plan")
@plan_options
@json_option("Print the plan as JSON.")
def plan_command(config: str | None, as_json: bool, **plan_args: Any) -> None:
    """Show how workers would be placed on this machine's cores and NUMA nodes."""
    settings, _ = plan_settings(config)
    result = make_plan(settings=settings, **plan_args)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(result.workers)} worker(s) on {result.topology_summary}")
    for column in ("worker", "node", "cpus", "threads", "slots"):
        table.add_column(column, justify="right" if column in ("node", "threads", "slots") else "left")
    for w in result.workers:
        node = "-" if w.numa_node is None else str(w.numa_node)
        table.add_row(w.name, node, w.cpu_list, str(w.threads), str(w.slots))
    console = Console()
    console.print(table)
    if result.reserved_cpus:
        reserved = result.to_dict()["reserved_cpus"]
        console.print(f"reserved cpus (Redis, OS): {reserved}")
    for note in result.notes:
        console.print(f"note: {note}", style="yellow", markup=False)


@click.command("ecosystem")
@click.option(
    "--format", "fmt", type=click.Choice((*FORMATS, "kubernetes")), required=True,
    help="Process manager (or kubernetes) to write config for.",
)
@plan_options
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    help="File to write (systemd: a directory for the units). Default: stdout.",
)
@click.option(
    "--command",
    "command",
    help="Command that runs the fleet CLI [default: the `fleet` next to this Python, else python -m].",
)
@click.option("--cwd", type=click.Path(file_okay=False, path_type=Path), help="Workers' working directory.")
@click.option(
    "--run-dir",
    default="%(here)s/run",
    show_default=True,
    help="supervisord: directory for its socket, pidfile and logs.",
)
@click.option("--env", "extra_env", multiple=True, help="Extra KEY=VALUE for every worker (repeatable).")
@click.option("--user", help="systemd: User= to run the workers as.")
@kubernetes_options
def ecosystem_command(
    fmt: Format | Literal["kubernetes"],
    config: str | None,
    output: Path | None,
    command: str | None,
    cwd: Path | None,
    run_dir: str,
    extra_env: tuple[str, ...],
    user: str | None,
    **args: Any,
) -> None:
    """Write a PM2, supervisord or systemd config, or Kubernetes manifests, for the planned workers."""
    k8s = {key: args.pop(key) for key in K8S_ARGS}
    plan_args = args
    settings, cfg = plan_settings(config)
    result = make_plan(settings=settings, **plan_args)
    if fmt == "kubernetes":
        write_kubernetes(result, settings, cfg, output, k8s)
        return
    env: dict[str, str] = {}
    for item in extra_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--env")
        env[key] = value
    options = RenderOptions(
        command=tuple(shlex.split(command)) if command else default_command(),
        config_path=str(cfg) if cfg else None,
        cwd=str((cwd or Path.cwd()).absolute()),
        drain_grace=settings.drain_grace,
        run_dir=run_dir,
        extra_env=env,
        user=user,
        generated_by=_invocation(fmt, plan_args),
    )
    files = render(result, fmt, options)
    if output is None:
        for name, text in files.items():
            if len(files) > 1:
                click.echo(f"# ==> {name} <==")
            click.echo(text, nl=False)
        return
    # systemd writes several files: OUTPUT is then a directory
    paths = [output / name for name in files] if fmt == "systemd" else [output]
    for path, text in zip(paths, files.values(), strict=True):
        _write(path, text)
        click.echo(f"wrote {path}", err=True)
    if fmt == "supervisord" and run_dir.startswith("%(here)s"):
        # supervisord does not create its run dir; make the default one next to the file
        Path(run_dir.replace("%(here)s", str(output.absolute().parent), 1)).mkdir(parents=True, exist_ok=True)


def _invocation(fmt: Format, plan_args: dict[str, Any]) -> str:
    """The plan part of the command line, for the generated files' headers."""
    parts = ["fleet ecosystem", f"--format {fmt}", f"--workers {plan_args['workers']}"]
    for key in ("cores_per_worker", "slots", "reserve_cores"):
        if plan_args.get(key):
            parts.append(f"--{key.replace('_', '-')} {plan_args[key]}")
    if plan_args.get("smt"):
        parts.append("--smt")
    return " ".join(parts)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def register(cli: click.Group) -> None:
    for command in (plan_command, ecosystem_command):
        cli.add_command(command)
