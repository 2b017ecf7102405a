"""`fleet soak`: the whole fleet under a randomized, seeded mix of traffic and faults, then every
invariant checked (ecosystem/soak/; docs/reliability.md, "Whole-fleet soak"). Exit status 1 on any
violation."""

from __future__ import annotations

import tempfile
from pathlib import Path

import click
from rich.console import Console

from ecosystem.soak.faults import KINDS
from ecosystem.soak.plan import SoakPlan
from ecosystem.soak.report import RichProgress, render, write_json
from ecosystem.soak.run import run_soak


@click.command()
@click.option("--seed", type=int, default=1, show_default=True,
              help="picks the traffic mix and the faults' order and times")
@click.option("--duration", type=click.FloatRange(20), default=120.0, show_default=True,
              help="seconds of traffic and faults (the quiet wait and the checks come after)")
@click.option("--backend", type=click.Choice(["fake", "llama-cpp"]), default="fake", show_default=True,
              help="the workers' engine: the fake (no model) or the real embedded model")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="write the whole result (every request, fault and violation) here")
@click.option("--dir", "run_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="the run's directory: config, Redis's AOF, every process's log "
              "(default: a new temporary one)")
@click.option("--workers", type=click.IntRange(2, 8), default=2, show_default=True)
@click.option("--gateways", type=click.IntRange(2, 4), default=2, show_default=True)
@click.option("--clients", type=click.IntRange(1, 64), default=6, show_default=True,
              help="concurrent client threads")
@click.option("--slots", type=click.IntRange(1, 64), default=8, show_default=True, help="slots per worker")
@click.option("--fault", "faults", multiple=True, type=click.Choice(list(KINDS)),
              help="inject only these kinds (repeatable; default: all)")
@click.option("--sentinel/--no-sentinel", default=False, show_default=True,
              help="a second phase on a Sentinel-managed Redis with a primary failover")
@click.option("--sentinel-duration", type=click.FloatRange(20), default=120.0, show_default=True)
def soak(seed: int, duration: float, backend: str, json_path: Path | None, run_dir: Path | None, workers: int,
         gateways: int, clients: int, slots: int, faults: tuple[str, ...], sentinel: bool,
         sentinel_duration: float) -> None:
    """Run a private fleet (Redis with AOF, workers, gateways, tenants) under seeded traffic and
    faults, then check every invariant; exit 1 on any violation."""
    directory = run_dir or Path(tempfile.mkdtemp(prefix="fleet-soak-"))
    plan = SoakPlan(seed=seed, duration=duration, backend=backend, run_dir=directory,  # type: ignore[arg-type]
                    workers=workers, gateways=gateways, clients=clients, slots=slots, faults=faults,
                    sentinel=sentinel, sentinel_duration=sentinel_duration)
    console = Console()
    if not console.is_terminal:  # a log file: wide enough for the report's tables
        console = Console(width=150)
    progress = RichProgress(console)
    try:
        result = run_soak(plan, progress)
    finally:
        progress.close()
    if json_path is not None:
        write_json(result, json_path)
    render(result, console)
    if json_path is not None:
        console.print(f"JSON: {json_path}")
    raise SystemExit(0 if result.ok else 1)


def register(group: click.Group) -> None:
    group.add_command(soak)
