"""What the loop is doing in the engine, for the watchdog (worker/liveness/watchdog.py): the loop
runs each engine call inside `LoopWatch.engine`, the watchdog thread reads `LoopWatch.call`."""

from __future__ import annotations

import faulthandler
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

ADMITTING = "admitting a job"
STEPPING = "stepping"


@dataclass(frozen=True)
class EngineCall:
    what: str  # "admitting a job", "stepping"
    jobs: Callable[[], tuple[str, ...]]  # the jobs it is for, read when it is found stuck
    started: float  # time.monotonic()


class LoopWatch:
    """What the loop is doing in the engine now: set by the loop, read by the watchdog thread."""

    def __init__(self) -> None:
        self.call: EngineCall | None = None
        self.backstop: float | None = None  # seconds: the worker process arms a C timer for admissions

    @contextmanager
    def engine(self, what: str, jobs: Callable[[], tuple[str, ...]]) -> Iterator[None]:
        outer, self.call = self.call, EngineCall(what, jobs, time.monotonic())
        backstop = self.backstop if what == ADMITTING else None
        if backstop is not None:
            faulthandler.dump_traceback_later(backstop, exit=True)
        try:
            yield
        finally:
            if backstop is not None:
                faulthandler.cancel_dump_traceback_later()
            self.call = outer
