"""What a job's writes carry beside the job's own: hooks, chosen when the worker is built.

The fleet's own writes about a job (worker/serving/endings.py: its start, its text, its one final entry,
a hand-back for another attempt) are fenced by ownership and sent on as few round trips as they
can be. Other concerns (a batch line's record, the observability facts; later tenants' usage)
ride on those same pipelines: a hook only queues commands on the pipeline it is handed and never
sends one, so what it writes lands in the same MULTI as the job's own write (applied only while
this worker still holds the job: exactly once) and costs no round trip of its own.

- `on_start`: inside the start's MULTI;
- `on_restart`: an attempt ended without a result and the job goes round again (or, when the
  reaper gives up, has failed): an engine restart on the step's text pipeline; a hand-back or a
  reaper's failure on a pipeline of its own after the script (sent only if a hook queued on it);
- `on_end`: inside the final write's MULTI.

A new concern is one module with a class of these three methods, and one line in
worker/assembly.py, which chooses the hooks; the loop and the reaper call whatever hooks they
were given and never name a concern.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from redis.client import Pipeline

if TYPE_CHECKING:
    from worker.job import ClaimedJob, Ending


@dataclass(frozen=True)
class Holder:
    """Whose write a hook joins: the worker whose in-flight list fences it (the reaper writes a
    dead worker's ending under that worker's name), its backend ("" when the reaper does not
    know it), and how long the job's result is kept."""

    worker: str
    backend: str
    result_ttl: int


@dataclass(frozen=True)
class Restart:
    """Attempt `attempt` of a job ended without a result, for `reason`, seen by `by` (a worker's
    name, or "engine"); `reaped`: by the reaper; `requeued`: False when the job failed instead."""

    job_id: str
    queue: str
    attempt: int
    reason: str
    by: str
    reaped: bool = False
    requeued: bool = True


class JobHook(Protocol):
    """A concern written with a job's start, restarts and ending; it only queues on `pipe`."""

    def on_start(self, job: ClaimedJob, holder: Holder, pipe: Pipeline) -> None: ...

    def on_restart(self, restart: Restart, pipe: Pipeline) -> None: ...

    def on_end(self, job: ClaimedJob, ending: Ending, holder: Holder, pipe: Pipeline) -> None: ...


class EndingHook:
    """A concern that writes only when a job ends (a start or a restart changes nothing of it):
    subclasses give `on_end`."""

    def on_start(self, job: ClaimedJob, holder: Holder, pipe: Pipeline) -> None:
        pass

    def on_restart(self, restart: Restart, pipe: Pipeline) -> None:
        pass


Hooks = Sequence[JobHook]

