"""The producer API: submit jobs, stream their tokens, wait for results, cancel.

    fleet = Fleet(redis_url="redis://127.0.0.1:6379/0")
    job = fleet.submit(prompt="Once upon a time", max_tokens=64, priority="high")
    for text in job.stream(): print(text, end="")
    res = job.result(timeout=60)
    vectors = fleet.embed(["first text", "second text"])    # an embedding job: one vector each

Requests are validated (pydantic) before anything reaches Redis. A job is a plain RQ job (JSON
serializer, function `dispatcher.jobs.generate`) on queue `<pool>:<priority>`, so stock RQ tools
see it and plain RQ producers can enqueue the same thing. What to write and read is decided in
dispatcher/rules.py, shared with AsyncFleet; this class runs it on a sync client.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, Self, TypeVar

from redis import Redis

from backends.contract.connect import redis_from_url
from backends.contract.embed import embed_fields, embeddings_of
from backends.contract.keys import queue_name
from backends.contract.retry import OUTAGE_ERRORS, retry_outage
from backends.contract.schema import JobResult
from backends.contract.settings import ProducerSettings, load
from backends.contract.stream import StreamEvent
from dispatcher import stream
from dispatcher.durability import DURABILITY_MODES, Durability, enqueue_replicated, push_wake
from dispatcher.plans import Plan, run
from dispatcher.rules import (
    CLIENT_OPTIONS,
    UNREACHABLE,
    JobTimeout,
    PreparedJob,
    cancel_plan,
    enqueue_plan,
    final_result,
    prepare,
    status_plan,
    timed_out,
)
from dispatcher.stream import JobFailed, JobRestarted, TextDeltas

__all__ = ["Fleet", "FleetJob", "JobTimeout", "ProducerBase"]
T = TypeVar("T")


class ProducerBase:
    """What the sync `Fleet` and `AsyncFleet` (dispatcher.aio) share: settings, and a request
    turned into one PreparedJob (dispatcher/rules.py)."""

    def __init__(self, redis_url: str | None = None, *, pool: str = "llm", result_ttl: int = 3600,
                 job_timeout: int = 600, queue_ttl: int | None = None, retry_for: float = 30.0,
                 durability: Durability = "primary", replica_timeout: float = 1.0) -> None:
        self.redis_url = redis_url or "redis://127.0.0.1:6379/0"
        self.pool = pool
        self.result_ttl = result_ttl
        self.job_timeout = job_timeout
        self.queue_ttl = queue_ttl
        self.retry_for = retry_for
        if durability not in DURABILITY_MODES:
            raise ValueError(f"durability must be one of {', '.join(DURABILITY_MODES)}, not {durability!r}")
        self.durability = durability  # dispatcher/durability.py: what each mode promises and costs
        self.replica_timeout = replica_timeout

    @classmethod
    def from_settings(cls, config: str | None = None) -> Self:
        """A producer on the shared config (worker-config.json + FLEET_* env); worker keys are ignored."""
        s = load(ProducerSettings, config)
        return cls(s.redis_url, pool=s.pool, result_ttl=s.result_ttl, job_timeout=s.job_timeout,
                   queue_ttl=s.queue_ttl, durability=s.durability)

    def _prepare(self, prompt: str | None, priority: str, queue_ttl: int | None, job_timeout: int | None,
                 fields: dict[str, Any]) -> PreparedJob:
        job_id = fields.pop("job_id", None)
        return prepare(prompt, priority, fields, job_timeout=job_timeout or self.job_timeout,
                       result_ttl=self.result_ttl, queue_ttl=queue_ttl or self.queue_ttl, job_id=job_id)


class Fleet(ProducerBase):
    """Producer handle on one pool. Every call rides out a Redis outage: it retries on a backoff
    for up to `retry_for` seconds (stream/result: until their own timeout) before raising."""

    def __init__(self, redis_url: str | None = None, *, pool: str = "llm", redis: Redis | None = None,
                 result_ttl: int = 3600, job_timeout: int = 600, queue_ttl: int | None = None,
                 retry_for: float = 30.0, durability: Durability = "primary",
                 replica_timeout: float = 1.0) -> None:
        super().__init__(redis_url, pool=pool, result_ttl=result_ttl, job_timeout=job_timeout,
                         queue_ttl=queue_ttl, retry_for=retry_for, durability=durability,
                         replica_timeout=replica_timeout)
        if redis is None:
            # this class decides how long to wait through an outage (reconnect.py)
            redis = redis_from_url(self.redis_url, **CLIENT_OPTIONS)
        self.redis = redis

    def submit(self, prompt: str | None = None, *, priority: str = "default", queue_ttl: int | None = None,
               job_timeout: int | None = None, **fields: Any) -> FleetJob:
        """Validate and enqueue one generation job. Raises ValueError naming any bad field.

        `queue_ttl`: seconds the job may wait in the queue before its first run; a job claimed
        later fails with "expired". `job_timeout`: wall seconds one run may take."""
        job = self._prepare(prompt, priority, queue_ttl, job_timeout, fields)
        queue = queue_name(self.pool, job.priority)
        if self.durability == "replicated":
            enqueue_replicated(self.redis, lambda conn: run(conn, enqueue_plan(job, queue, retried=False)),
                               job.job_id, self.pool, self.replica_timeout, self.retry_for)
            return FleetJob(self, job.job_id)
        tries = 0

        def enqueue() -> None:
            nonlocal tries
            tries += 1
            run(self.redis, enqueue_plan(job, queue, retried=tries > 1))

        self._retry(enqueue)
        with contextlib.suppress(*OUTAGE_ERRORS):
            push_wake(self.redis, self.pool)
        return FleetJob(self, job.job_id)

    def submit_embed(self, texts: str | Sequence[str], *, priority: str = "default",
                     queue_ttl: int | None = None, job_timeout: int | None = None, **fields: Any) -> FleetJob:
        """Enqueue one embedding job: a vector per text (a string is one text), in its result's
        `embeddings` (base64 float32; `embeddings_of(result)` decodes them). `fields`:
        `dimensions`, `truncate`, `normalize`, `tenant`, `job_id` (backends/contract/embed.py)."""
        return self.submit(priority=priority, queue_ttl=queue_ttl, job_timeout=job_timeout,
                           **embed_fields(texts, **fields))

    def embed(self, texts: str | Sequence[str], *, timeout: float | None = 60.0,
              **options: Any) -> list[list[float]]:
        """The texts' vectors (L2-normalised unless `normalize=False`), in order; `options` as
        `submit_embed`'s. Raises ValueError (a bad request), JobFailed, JobTimeout."""
        return embeddings_of(self.submit_embed(texts, **options).result(timeout))

    def job(self, job_id: str) -> FleetJob:
        return FleetJob(self, job_id)

    def _retry(self, call: Callable[[], T]) -> T:
        return retry_outage(call, time.monotonic() + self.retry_for)

    def _run(self, make_plan: Callable[[], Plan[T]]) -> T:
        """A fresh plan from `make_plan` on each try through an outage."""
        return self._retry(lambda: run(self.redis, make_plan()))


class FleetJob:
    def __init__(self, fleet: Fleet, job_id: str) -> None:
        self.fleet = fleet
        self.id = job_id

    def __repr__(self) -> str:
        return f"FleetJob({self.id!r})"

    def events(self, timeout: float | None = None) -> Iterator[StreamEvent]:
        """The job's live stream entries from the first, then new ones, until the job ends.

        Entries of a void attempt are left out; when a new attempt replaces text already yielded,
        a `restart` event comes first (dispatcher/stream.py has the rules)."""
        deadline = time.monotonic() + timeout if timeout else None
        yield from stream.read_events(self.fleet.redis, self.id, deadline=deadline)

    def __enter__(self) -> FleetJob:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        """`with fleet.submit(...) as job:` cancels the job when the block is left by an exception
        (Ctrl-C included) before the job ended; JobRestarted and JobFailed do not cancel."""
        if exc_type is not None and not issubclass(exc_type, JobRestarted | JobFailed):
            self.cancel_quietly()

    def cancel_quietly(self) -> None:
        """Cancel on the way out of an interrupted read: one try, never raising (Redis may be gone)."""
        with contextlib.suppress(Exception):
            self._cancel()

    def stream(self, timeout: float | None = None, *, detach: bool = False) -> Generator[str, None, None]:
        """Text deltas as they are generated; joined, they are the final result's text.

        A job whose worker dies (or whose engine fails) mid-generation runs again as a new
        attempt, and the dead attempt's text is void. The stream then holds the new attempt's
        text back until it passes what was already yielded:
        - if the new attempt reproduces that text (greedy or seeded sampling on the same engine
          usually does), the deltas just go on: the consumer sees nothing of the restart;
        - if it diverges, JobRestarted is raised (`.delivered` is the void text). Discard what
          was shown and call stream() again: a new call starts with the live attempt's first
          token and never replays a dead attempt.
        Raises JobFailed if the job fails; returns at the end of the job (or after `timeout`).

        Interrupted (Ctrl-C, or the generator closed before the job ended, e.g. by leaving a
        `with`/`finally` around the loop), it cancels the job, unless `detach=True`: nobody
        would read what the worker goes on generating."""
        try:
            yield from self._stream(timeout)
        except (GeneratorExit, KeyboardInterrupt):
            if not detach:
                self.cancel_quietly()
            raise

    def _stream(self, timeout: float | None) -> Iterator[str]:
        deltas = TextDeltas(self.id)
        for ev in self.events(timeout):
            if delta := deltas.feed(ev):
                yield delta
            if deltas.ended:
                return

    def result(self, timeout: float | None = 60.0) -> JobResult:
        """Block until the job ends; return its one final result or raise JobFailed / JobTimeout.
        Waits through Redis outages (until `timeout`)."""
        for ev in self.events(timeout):
            if (result := final_result(self.id, ev)) is not None:
                return result
        try:
            status = self.status()
        except OUTAGE_ERRORS:
            status = UNREACHABLE
        raise timed_out(self.id, timeout, status)

    def status(self) -> str:
        return self.fleet._run(lambda: status_plan(self.id))

    def cancel(self) -> str:
        """Cancel: a queued job is removed at once; a running one stops at its next step.
        Returns 'cancelled' (was queued), 'cancelling' (running) or the final status."""
        return self.fleet._run(self._cancel_plan)

    def _cancel(self) -> str:
        return run(self.fleet.redis, self._cancel_plan())

    def _cancel_plan(self) -> Plan[str]:
        return cancel_plan(self.id, self.fleet.result_ttl, self.fleet.job_timeout)
