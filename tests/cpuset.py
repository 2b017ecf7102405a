"""The CPUs this process may be moved to (its cpuset): wider than the one core a pinned test
runner hands down (scripts/test, tests/conftest.py). A test whose subject is placing processes on
the box's cores plans against this set and starts them on it."""

from __future__ import annotations

import os


def cpuset_cpus() -> set[int]:
    """Every CPU the kernel lets this thread run on; its own mask is left as it was."""
    mine = os.sched_getaffinity(0)
    try:
        # a mask wider than the cpuset is cut to it by the kernel, not refused
        os.sched_setaffinity(0, range(max(os.cpu_count() or 1, max(mine) + 1)))
        return os.sched_getaffinity(0)
    finally:
        os.sched_setaffinity(0, mine)


def on_cpuset() -> None:
    """`preexec_fn` for a process that plans its own placement on the whole box."""
    os.sched_setaffinity(0, cpuset_cpus())
