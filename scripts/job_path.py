"""The files one job really crosses, measured: submit → claim → engine steps → final write → read.

Starts a private redis-server, builds a worker in this process (on the real engine with
`--engine llama-cpp`, the default, or the fake one), then profiles only the job's own path: one
`Fleet.submit`, the worker's loop until idle, and `Job.result()`. Every project file in which a
function ran during that window is listed, grouped by package, with how many calls it took; the
contract (`backends/contract/`) is counted apart, as docs/ARCHITECTURE.md does. Start-up (model
load, worker registration) runs before the profiler starts and is not counted.

    .venv/bin/python scripts/job_path.py [--engine fake] [--json out.json] [--write-docs | --check-docs]

docs/ARCHITECTURE.md quotes what this measures between `<!-- job-path -->` markers, and the
worker's tree between `<!-- worker-tree -->` markers: `--write-docs` rewrites both blocks,
`--check-docs` exits 1 when either differs from what is measured now (tests/test_docs_true.py).
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
from worker.serving.loop import FleetWorker  # noqa: E402
from worker.settings import FleetSettings  # noqa: E402

PACKAGES = ("dispatcher", "worker", "backends", "ecosystem")
DOC = ROOT / "docs" / "ARCHITECTURE.md"


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


def render_path(calls: Counter[str]) -> str:
    """The job's files, by folder, as the doc quotes them."""
    contract = sorted(f for f in calls if f.startswith("backends/contract/"))
    path = sorted(f for f in calls if f not in contract)
    by_folder: dict[str, list[str]] = {}
    for name in path:
        folder, _, file = name.rpartition("/")
        by_folder.setdefault(folder, []).append(file)
    lines = [f"One job crosses **{len(path)} files** besides **{len(contract)} of the contract** "
             f"(the in-process engine; `scripts/job_path.py`):", ""]
    lines += [f"- `{folder}/`: {', '.join(files)}" for folder, files in by_folder.items()]
    lines += [f"- the contract: {', '.join(f.removeprefix('backends/contract/') for f in contract)}"]
    return "\n".join(lines)


def render_tree() -> str:
    """The worker's folders and their modules, each folder with its docstring's first line."""
    lines = ["```"]
    top = ROOT / "worker"
    for folder in [top, *sorted(p for p in top.iterdir() if (p / "__init__.py").exists())]:
        modules = sorted(p.name for p in folder.iterdir()
                         if p.suffix in (".py", ".lua") and p.name != "__init__.py")
        lines.append(f"{folder.relative_to(ROOT)}/  {' '.join(modules)}")
    lines.append("```")
    return "\n".join(lines)


def replace_block(text: str, name: str, body: str) -> str:
    begin, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    head, found, rest = text.partition(begin)
    if not found or end not in rest:
        raise click.ClickException(f"{DOC} has no {begin} ... {end} block")
    return head + begin + "\n" + body + "\n" + end + rest.partition(end)[2]


@click.command()
@click.option("--engine", type=click.Choice(["llama-cpp", "fake"]), default="llama-cpp", show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--write-docs", is_flag=True, help="rewrite docs/ARCHITECTURE.md's measured blocks")
@click.option("--check-docs", is_flag=True, help="exit 1 when docs/ARCHITECTURE.md's blocks drifted")
def main(engine: str, json_out: Path | None, write_docs: bool, check_docs: bool) -> None:
    calls = measure(engine)
    if write_docs or check_docs:
        now = DOC.read_text()
        want = replace_block(replace_block(now, "job-path", render_path(calls)), "worker-tree", render_tree())
        if write_docs:
            DOC.write_text(want)
        elif want != now:
            sys.exit(f"{DOC.relative_to(ROOT)} differs from what scripts/job_path.py measures now; "
                     f"run it with --write-docs")
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
