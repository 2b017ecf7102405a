"""Kubernetes: the options of `fleet ecosystem --format kubernetes` and `fleet scale --suggest`
(the worker count the queues call for, by the ScaledObject's formula)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from ecosystem.cli.options import config_option, json_option
from ecosystem.kubernetes import KubernetesOptions, render_kubernetes, suggest_scale
from ecosystem.planner import Plan
from worker.settings import FleetSettings

F = TypeVar("F", bound=Callable[..., Any])


def scaling_options(func: F) -> F:
    options = [
        click.option("--ttft-target", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
                     help="Seconds a queued job may wait for its first token (sets the KEDA target)."),
        click.option("--tokens-per-s", type=click.FloatRange(min=0.1), default=None,
                     help="One worker's throughput [default: measured per core x cores, docs/bench.md]."),
        click.option("--min-workers", type=click.IntRange(min=0), default=1, show_default=True),
        click.option("--max-workers", type=click.IntRange(min=1), default=10, show_default=True),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def kubernetes_options(func: F) -> F:
    options = [
        click.option("--image", default=KubernetesOptions.image, show_default=True,
                     help="kubernetes: container image with llama-fleet installed."),
        click.option("--namespace", default=None, help="kubernetes: namespace for kustomization.yaml."),
        click.option("--memory-mib", type=click.IntRange(min=64), default=None,
                     help="kubernetes: memory per worker [default: the sizing estimate, docs/placement.md]."),
        scaling_options,
    ]
    for option in reversed(options):
        func = option(func)
    return func


def write_kubernetes(plan: Plan, settings: FleetSettings, config_file: Path | None, output: Path | None,
                     k8s: dict[str, Any]) -> None:
    """Render; to stdout (Secret values redacted) or into the directory OUTPUT (Secrets in full,
    mode 0600, since they hold the Redis credentials and the gateway's keys)."""
    config: dict[str, Any] = {}
    if config_file is not None and config_file.exists():
        config = json.loads(config_file.read_text())
    options = KubernetesOptions(image=k8s["image"], namespace=k8s["namespace"],
                                ttft_target_s=k8s["ttft_target"], min_workers=k8s["min_workers"],
                                max_workers=k8s["max_workers"], tokens_per_s=k8s["tokens_per_s"],
                                memory_mib=k8s["memory_mib"], show_secrets=output is not None)
    try:
        files = render_kubernetes(plan, settings, config, options)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if output is None:
        for name, text in files.items():
            click.echo(f"# ==> {name} <==")
            click.echo(text, nl=False)
        return
    output.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        path = output / name
        path.write_text(text)
        if name.endswith("secret.yaml"):
            path.chmod(0o600)
        click.echo(f"wrote {path}", err=True)
    if not settings.gateway.api_keys:
        click.echo("note: gateway.api_keys is empty, so the gateway answers anyone who reaches its Service: "
                   f"put keys in {output / 'gateway-secret.yaml'} (api-keys: a JSON list)", err=True)
    click.echo(f"apply with: kubectl apply -k {output}  (secret.yaml and gateway-secret.yaml hold "
               "credentials: keep them private)", err=True)


@click.command("scale")
@config_option()
@click.option("--suggest", is_flag=True, required=True,
              help="Print the worker count the queue depth and TTFT target call for.")
@click.option("--cores", type=click.IntRange(min=1), default=None,
              help="Cores per worker [default: the live workers' mean, else 2].")
@json_option()
@scaling_options
def scale_command(config: str | None, suggest: bool, cores: int | None, as_json: bool, ttft_target: float,
                  tokens_per_s: float | None, min_workers: int, max_workers: int) -> None:
    """Suggest a worker count from the pool's queue depth (the KEDA ScaledObject's formula)."""
    from backends.contract.connect import redis_from_url
    from worker.settings import SettingsError, load_settings

    try:
        settings = load_settings(config)
    except SettingsError as e:
        raise click.ClickException(str(e)) from None
    redis = redis_from_url(settings.redis_url, socket_connect_timeout=3, socket_timeout=10)
    s = suggest_scale(redis, settings, cores, ttft_target, tokens_per_s, min_workers, max_workers)
    if as_json:
        click.echo(json.dumps(s.row()))
        return
    target = s.target_per_worker
    click.echo(f"{s.queued} queued, {s.live_workers} live worker(s); one worker starts ~{target} queued jobs "
               f"within {ttft_target:g}s ({s.jobs_per_s:.2f} jobs/s)")
    click.echo(f"suggested workers: {s.suggested_workers}  (= ceil({s.queued} / {target}) within "
               f"[{min_workers}, {max_workers}], as the KEDA ScaledObject computes)")


def register(cli: click.Group) -> None:
    cli.add_command(scale_command)
