"""How many processes a test run starts: real `fleet worker`s, `fleet serve` gateways,
llama-servers, redis-servers, other Python processes.

    .venv/bin/python scripts/suite_census.py [--json out.json] -- [pytest args]
    .venv/bin/python scripts/suite_census.py --durations out.tests.jsonl

The first runs pytest with scripts/suite_census/ on PYTHONPATH (every process it starts records
itself), prints the counts, and with --json writes them and each test's wall and CPU seconds
(out.tests.jsonl). The second turns such a file into tests/durations.json: each module's seconds,
which tests/conftest.py reads to start the longest modules first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent


def kind_of(record: dict[str, object]) -> str:
    raw = record["argv"]
    argv = [str(a) for a in raw] if isinstance(raw, list) else []
    if record["kind"] == "exec":
        return argv[0] if argv else "?"
    words = argv[1:4]
    if "ecosystem.cli" in words or any(a.endswith("/fleet") for a in words[:1]):
        rest = argv[argv.index("ecosystem.cli") + 1:] if "ecosystem.cli" in argv else argv[2:]
        return f"fleet {rest[0]}" if rest else "fleet"
    if "pytest" in words or "xdist" in " ".join(argv):
        return "pytest"
    return "other python"


def census(path: Path) -> Counter[str]:
    counts: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        counts[kind_of(json.loads(line))] += 1
    return counts


def write_durations(tests_jsonl: Path, out: Path = HERE.parent / "tests" / "durations.json") -> None:
    seconds: Counter[str] = Counter()
    for line in tests_jsonl.read_text().splitlines():
        row = json.loads(line)
        seconds[row["test"].split("::")[0].rsplit("/", 1)[-1]] += row["wall"]
    out.write_text(json.dumps({m: round(s) for m, s in sorted(seconds.items())}, indent=0) + "\n")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--durations"]:
        write_durations(Path(argv[1]))
        return 0
    out = None
    if argv[:1] == ["--json"]:
        out, argv = Path(argv[1]), argv[2:]
    tests_out = out.with_suffix(".tests.jsonl") if out else None
    if argv[:1] == ["--"]:
        argv = argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "census.jsonl"
        path = [str(HERE / "suite_census"), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "SUITE_CENSUS": str(log), "PYTHONPATH": os.pathsep.join(path),
               "SUITE_CENSUS_TESTS": str(tests_out or Path(tmp) / "tests.jsonl")}
        rc = subprocess.call([sys.executable, "-m", "pytest", "-p", "cpu_per_test", *argv], env=env)
        counts = census(log) if log.exists() else Counter()
    print("\nprocesses started:")
    for kind, n in counts.most_common():
        print(f"  {n:6d}  {kind}")
    if out:
        out.write_text(json.dumps(dict(counts.most_common()), indent=2) + "\n")
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
