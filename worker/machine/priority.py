"""A starting worker yields the CPU to the workers already serving beside it.

A worker that starts (a deploy, or its supervisor restarting it after a crash or a hang) loads and
warms its model for a second or more of CPU on cores that serving workers decode on, and their
streams pause while it does. So from its start until it serves, the worker runs `start_nice`
steps nicer, then goes back to its own priority. Linux keeps a niceness per thread: every thread
made meanwhile (llama.cpp's, the heartbeat) is set back too, except those that chose their own.

Only where going back is allowed: an unprivileged process may raise its niceness but never lower
it again (unless CAP_SYS_NICE or RLIMIT_NICE permits), and a worker left nice for good would lose
every contended core. There, starting is left as it was.
"""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Iterator
from pathlib import Path

CAP_SYS_NICE = 23


@contextlib.contextmanager
def starting_gently(nice: int) -> Iterator[None]:
    """Run the block `nice` steps nicer, when the process may come back from it afterwards."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    if nice <= 0 or not may_lower_to(own):
        yield
        return
    raised = min(19, own + nice)
    os.setpriority(os.PRIO_PROCESS, 0, raised)
    try:
        yield
    finally:
        for tid in _threads():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                if os.getpriority(os.PRIO_PROCESS, tid) == raised:
                    os.setpriority(os.PRIO_PROCESS, tid, own)


def may_lower_to(nice: int) -> bool:
    """Whether this process may set a niceness as low as `nice` again after raising it."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    if soft == resource.RLIM_INFINITY or 20 - nice <= soft:
        return True
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_NICE & 1)
    return False


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the calling thread is the process
        return [0]
