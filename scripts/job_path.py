"""The files one job really crosses, measured: submit → claim → engine steps → final write → read.

Starts a private redis-server, builds a worker in this process (on the real engine with
`--engine llama-cpp`, the default, or the fake one), then profiles only the job's own path: one
`Fleet.submit`, the worker's loop until idle, and `Job.result()`. Every project file in which a
function ran during that window is listed, grouped by package, with how many calls it took; the
contract (`backends/contract/`) is counted apart, as docs/ARCHITECTURE.md does. Start-up (model
load, worker registration) runs before the profiler starts and is not counted.

    .venv/bin/python scripts/job_path.py [--engine fake] [--json out.json]
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import click
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.contract.keys import worker_key  # noqa: E402
from backends.registry import backend_settings, make_backend  # noqa: E402
from dispatcher import Fleet  # noqa: E402
from ecosystem.local.processes import RedisServer  # noqa: E402
from worker.assembly import job_hooks  # noqa: E402
from worker.inprocess import worker_client  # noqa: E402
from worker.loop import FleetWorker  # noqa: E402
from worker.settings import FleetSettings  # noqa: E402

PACKAGES = ("dispatcher", "worker", "backends", "ecosystem")


def project_file(filename: str) -> str | None:
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    return str(rel) if rel.parts[0] in PACKAGES else None


def measure(engine: str) -> Counter[str]:
    calls: Counter[str] = Counter()

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event == "call" and (name := project_file(frame.f_code.co_filename)):
            calls[name] += 1

    with tempfile.TemporaryDirectory() as tmp, RedisServer.start(Path(tmp)) as redis:
        backend = {"type": engine, "slots": 2}
        settings = FleetSettings(redis_url=redis.url, name="path", backend=backend)
        fw = FleetWorker(settings, make_backend(backend_settings(backend)), worker_client(redis.url), "path",
                         hooks=job_hooks(settings))
        redis.client().set(worker_key("path"), "{}", px=600_000)  # alive, as its heartbeat would say
        fleet = Fleet(redis.url)
        fleet.submit(prompt="warm up", max_tokens=2)
        fw.run_until_idle(timeout=120)  # start-up paths (first claim, first decode) off the count
        sys.setprofile(profile)
        try:
            job = fleet.submit(prompt="Name three colours.", max_tokens=8, temperature=0)
            fw.run_until_idle(timeout=120)
            result = job.result(timeout=60)
        finally:
            sys.setprofile(None)
        assert result.text, "the job produced no text"
        fw.backend.close()
    return calls


@click.command()
@click.option("--engine", type=click.Choice(["llama-cpp", "fake"]), default="llama-cpp", show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path))
def main(engine: str, json_out: Path | None) -> None:
    calls = measure(engine)
    contract = sorted(f for f in calls if f.startswith("backends/contract/"))
    path = sorted(f for f in calls if f not in contract)
    title = f"one job's path ({engine} engine): {len(path)} files, + {len(contract)} of the contract"
    table = Table(title=title)
    table.add_column("file")
    table.add_column("calls", justify="right")
    for name in path + contract:
        table.add_row(name, str(calls[name]))
    Console().print(table)
    if json_out:
        json_out.write_text(json.dumps({"engine": engine, "files": {f: calls[f] for f in path},
                                        "contract": {f: calls[f] for f in contract}}, indent=1))


if __name__ == "__main__":
    main()
