"""Regenerate ecosystem/examples/: renders for a 2 x 16-core, 2-node box (with SMT).

    python scripts/render_examples.py          # write
    python scripts/render_examples.py --check  # exit 1 if the committed examples are stale

The machine is the recorded sysfs tree tests/fixtures/sysfs/2node-16core-smt; the install paths
are the conventional /opt and /etc ones, since the examples document a deployment, not this box.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ecosystem.planner import plan  # noqa: E402
from ecosystem.render import Format, RenderOptions, render  # noqa: E402
from ecosystem.topology import read_topology  # noqa: E402

EXAMPLES = REPO / "ecosystem" / "examples"
SYSFS = REPO / "tests" / "fixtures" / "sysfs" / "2node-16core-smt"


def options(fmt: Format) -> RenderOptions:
    return RenderOptions(
        command=("/opt/llama-fleet/.venv/bin/fleet",),
        config_path="/etc/llama-fleet/worker-config.json",
        cwd="/opt/llama-fleet",
        drain_grace=20.0,
        user="llama-fleet" if fmt == "systemd" else None,
        generated_by=f"fleet ecosystem --format {fmt} --workers auto",
    )


def example_files() -> dict[Path, str]:
    the_plan = plan(read_topology(SYSFS), workers="auto", slots=16)
    files: dict[Path, str] = {}
    targets: list[tuple[Format, Path]] = [
        ("pm2", EXAMPLES),
        ("supervisord", EXAMPLES),
        ("systemd", EXAMPLES / "systemd"),
    ]
    for fmt, where in targets:
        for name, text in render(the_plan, fmt, options(fmt)).items():
            files[where / name] = text
    return files


def main() -> int:
    files = example_files()
    if "--check" in sys.argv:
        stale = [
            str(p.relative_to(REPO)) for p, text in files.items() if not p.exists() or p.read_text() != text
        ]
        if stale:
            print("stale examples (run scripts/render_examples.py):", *stale, sep="\n  ")
            return 1
        return 0
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
