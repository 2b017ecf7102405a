"""`fleet usage`: what each tenant used (requests, tokens, cached prompt tokens, queue wait, refusals
by limit), read from the counters the workers and gateways keep in Redis (dispatcher/tenants.py);
with `--period`, its spend over a day, week or month against its budget."""

from __future__ import annotations

import json
import re

import click
from rich.console import Console
from rich.table import Table

from backends.contract.schema import TENANT_PATTERN
from dispatcher.plans import run
from dispatcher.tenants import LIMIT_NAMES, BudgetLine, budget_report_plan, usage_plan, utc
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
@click.option("--period", type=click.Choice(["day", "week", "month"]), default=None,
              help="spend over this UTC day, ISO week or month (the last 1, 7 or 30 days for a rolling "
              "budget) against the tenant's budget")
@json_option("one JSON object: tenant -> counts (with --period: a list of spends)")
@friendly_errors
def usage(config: str | None, tenant: str | None, since: str, period: str | None, as_json: bool) -> None:
    """Requests, tokens, queue wait and refusals per tenant; spend against budgets (--period)."""
    if tenant is not None and not re.match(TENANT_PATTERN, tenant):
        raise click.BadParameter("1..64 of A-Z a-z 0-9 _ . -", param_hint="--tenant")
    settings, redis = settings_and_redis(config)
    if period is not None:
        lines = run(redis, budget_report_plan(settings.gateway.tenants, tenant, period))
        if as_json:
            click.echo(json.dumps([line.json() for line in lines], indent=1, sort_keys=True))
        else:
            Console().print(budget_table(lines, period))
        return
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


def budget_table(lines: list[BudgetLine], period: str) -> Table:
    table = Table(title=f"spend this {period} (UTC) against budgets")
    for col in ("tenant", "period", "prompt tokens", "cached", "completion tokens", "spent", "budget",
                "used", "resets (UTC)", "cost"):
        table.add_column(col, justify="left" if col in ("tenant", "period", "resets (UTC)") else "right")
    for line in lines:
        s, b = line.spend, line.budget
        table.add_row(line.tenant, line.period, f"{s.prompt_tokens:,}", f"{s.cached_tokens:,}",
                      f"{s.completion_tokens:,}", f"{s.tokens:,}",
                      "-" if b is None else f"{b.tokens:,} {'hard' if b.hard else 'soft'}",
                      "-" if b is None else f"{s.tokens / b.tokens:.0%}",
                      utc(s.resets_at).replace("T", " ").removesuffix("Z"),
                      "-" if line.cost is None else f"{line.cost:,.4f}")
    return table


def register(group: click.Group) -> None:
    group.add_command(usage)
