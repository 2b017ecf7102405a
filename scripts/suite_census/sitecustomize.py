"""Count the processes a test run starts, for scripts/suite_census.py.

Put this folder on PYTHONPATH and name a file in SUITE_CENSUS (not FLEET_*: the tests strip those
from a worker's environment): every Python process that starts appends one JSON line with its
argv, and every process it starts through subprocess (llama-server, redis-server, node) one more.
Only a probe: an audit hook that writes a short line per process start.
"""

from __future__ import annotations

import json
import os
import sys


def _record(path: str, kind: str, argv: list[str]) -> None:
    line = json.dumps({"kind": kind, "pid": os.getpid(), "argv": [str(a) for a in argv][:8]}) + "\n"
    # one small O_APPEND write a line: lines from processes running at once do not interleave
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _install(path: str) -> None:
    _record(path, "python", list(sys.orig_argv))

    def hook(event: str, args: tuple[object, ...]) -> None:
        if event == "subprocess.Popen":
            executable, argv = args[0], args[1]
            words = [str(a) for a in argv] if isinstance(argv, (list, tuple)) else [str(argv)]
            name = os.path.basename(str(executable or (words[0] if words else "")))
            if "python" not in name:  # a Python child records itself
                _record(path, "exec", [name, *words[1:]])

    sys.addaudithook(hook)


if os.environ.get("SUITE_CENSUS"):
    _install(os.environ["SUITE_CENSUS"])
