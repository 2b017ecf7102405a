"""`fleet usage`: what each tenant used (requests, tokens, cached prompt tokens, queue wait, refusals
by limit), read from the counters the workers and gateways keep in Redis (dispatcher/tenants.py)."""

from __future__ import annotations

import json
import re

import click
from rich.console import Console
from rich.table import Table

from backends.contract.schema import TENANT_PATTERN
from dispatcher.plans import run
from dispatcher.tenants import LIMIT_NAMES, usage_plan
from ecosystem.cli.options import config_option, friendly_errors, json_option, settings_and_redis

SINCE = re.compile(r"([0-9]{1,3})([hd])")
MAX_HOURS = 8 * 24  # what the counters keep


def hours_of(since: str) -> int:
    found = SINCE.fullmatch(since)
    if not found:
        raise click.BadParameter("a number of hours or days, e.g. 24h or 7d", param_hint="--since")
    hours = int(found.group(1)) * (24 if found.group(2) == "d" else 1)
    if not 1 <= hours <= MAX_HOURS:
        raise click.BadParameter(f"1h..{MAX_HOURS // 24}d (what the counters keep)", param_hint="--since")
    return hours


@click.command()
@config_option()
@click.option("--tenant", default=None, help="one tenant (default: every tenant seen)")
@click.option("--since", default="24h", show_default=True, help="the last N hours (24h) or days (7d)")
@json_option("one JSON object: tenant -> counts")
@friendly_errors
def usage(config: str | None, tenant: str | None, since: str, as_json: bool) -> None:
    """Requests, tokens, queue wait and refusals per tenant."""
    if tenant is not None and not re.match(TENANT_PATTERN, tenant):
        raise click.BadParameter("1..64 of A-Z a-z 0-9 _ . -", param_hint="--tenant")
    _, redis = settings_and_redis(config)
    counts = run(redis, usage_plan(tenant, hours_of(since)))
    if as_json:
        click.echo(json.dumps(counts, indent=1, sort_keys=True))
        return
    table = Table(title=f"usage, last {since}")
    for col in ("tenant", "requests", "prompt tokens", "cached", "completion tokens", "mean queue ms",
                "failed", "refused (limit)"):
        table.add_column(col, justify="left" if col in ("tenant", "refused (limit)") else "right")
    for name, c in counts.items():
        refused = ", ".join(f"{c[f'rejected_{n}']} {n}" for n in LIMIT_NAMES if c.get(f"rejected_{n}"))
        done = c["requests"] - c["failed"]
        table.add_row(name, f"{c['requests']:,}", f"{c['prompt_tokens']:,}", f"{c['cached_tokens']:,}",
                      f"{c['completion_tokens']:,}", f"{c['queue_ms'] / done:.0f}" if done else "-",
                      f"{c['failed']:,}", refused or "-")
    Console().print(table)


def register(group: click.Group) -> None:
    group.add_command(usage)
