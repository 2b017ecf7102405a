"""The `fleet` command line. The group lives here; each command module (this package's, and the
three commands kept beside their code: serve, health, bench) exposes `register(cli)`, called
from here only, so no command module imports the group."""

from __future__ import annotations

import click

from ecosystem.cli import jobs, worker


class FleetGroup(click.Group):
    """`worker`, `submit`, `job` and `jobs` are added at import; the rest on first use, so
    `fleet worker` does not import the gateway, batch, bench and Kubernetes code at every start."""

    _extensions_loaded = False

    def _load_extensions(self) -> None:
        if not self._extensions_loaded:
            self._extensions_loaded = True
            _register_extensions(self)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is None:
            self._load_extensions()
            command = super().get_command(ctx, cmd_name)
        return command

    def list_commands(self, ctx: click.Context) -> list[str]:
        self._load_extensions()
        return super().list_commands(ctx)


@click.group(cls=FleetGroup)
def cli() -> None:
    """llama-fleet: batched llama.cpp workers serving generation jobs from Redis."""


worker.register(cli)
jobs.register(cli)


def _register_extensions(group: click.Group) -> None:
    from dispatcher.gateway.serve import serve
    from ecosystem.cli import batch, ecosystem, kubernetes, models, observe, soak, up, usage
    from ecosystem.local import bench
    from worker import health

    for module in (ecosystem, kubernetes, up, batch, observe, usage, models, soak, bench, health):
        module.register(group)
    group.add_command(serve)


def main() -> None:
    cli(prog_name="fleet")
