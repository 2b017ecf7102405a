"""When the worker loop talks to Redis after a step (worker/serving/loop.py `_step`).

- Running jobs' new text goes out every `stream_interval`: at one user a step is ~11 ms, and a
  write per step is a script in Redis, a wake-up and an SSE write in the gateway, all on the cores
  the engine decodes on. A job's first text (time to first token), an ending and a hand-back go
  out after the step that made them.
- The running jobs' cancel flags are read every CANCEL_CHECK_INTERVAL, on the same pipeline when
  a write is due, alone when not: a fast engine steps every few ms, and reading them each step
  would outnumber the writes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from worker.job import ClaimedJob

CANCEL_CHECK_INTERVAL = 0.05  # seconds between looks at the running jobs' cancel flags (2 reads a job)


def urgent(jobs: Iterable[ClaimedJob], requeues: Mapping[str, object]) -> bool:
    """Writes that go out at once rather than at the next stream interval: an ending, a hand-back,
    an attempt's first text (what time to first token measures)."""
    return bool(requeues) or any(j.ending is not None or (j.unsent and not j.sent) for j in jobs)


@dataclass(frozen=True)
class Due:
    text: bool  # the jobs' unsent text, endings and hand-backs
    cancels: bool  # the running jobs' cancel flags

    def __bool__(self) -> bool:
        return self.text or self.cancels


EVERYTHING = Due(text=True, cancels=True)  # a drain's or a shutdown's last write


class WritePacer:
    def __init__(self, stream_interval: float) -> None:
        self.stream_interval = stream_interval
        self._write_at = 0.0  # next write of running jobs' text (monotonic)
        self._cancels_at = 0.0  # next look at the cancel flags (monotonic)

    def due(self, now: float, jobs: Iterable[ClaimedJob], requeues: Mapping[str, object]) -> Due:
        """What is due now; what is returned counts as done (its next time is set)."""
        due = Due(now >= self._write_at or urgent(jobs, requeues), now >= self._cancels_at)
        if due.text:
            self._write_at = now + self.stream_interval
        if due.cancels:
            self._cancels_at = now + CANCEL_CHECK_INTERVAL
        return due
