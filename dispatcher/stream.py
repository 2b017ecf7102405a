"""Reading a job's token stream (entries and their codec: backends/contract/stream.py).

What a reader does (read_events):
- The highest attempt wins. Text of a lower attempt is void: a dead attempt's partial text, or a
  straggler that a worker which lost the job during a Redis outage wrote late. When a higher
  attempt shows up after lower-attempt text was read, the reader yields a `restart` event.
- A text entry whose `n` was already read for its attempt is a duplicate (a worker re-sends a batch
  whose acknowledgement was lost when Redis went away) and is skipped.
- A job has exactly one final entry (d or e): workers write it only while they still hold the job
  (worker.serving.endings.commit_held), so a job that was taken over never gets a second one.
A late subscriber reads from the start, so it gets every token.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from typing import Any, cast

from redis import Redis

from backends.contract.keys import ATTEMPT_FIELD, FINAL_FIELD, job_key, stream_key
from backends.contract.replies import as_int, as_str
from backends.contract.retry import OUTAGE_ERRORS, Backoff, retry_outage
from backends.contract.stream import StreamEvent, decode
from dispatcher.plans import Plan, ask, cmd, run

# One XREAD reply: [(stream key, [(entry id, fields), ...]), ...]
XreadReply = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]


def live_attempt(redis: Redis, job_id: str) -> int:
    return run(redis, live_attempt_plan(job_id))


def live_attempt_plan(job_id: str) -> Plan[int]:
    """The attempt now running (or the last one, if the job ended): entries of earlier attempts
    are void. The job hash counts the attempts before the current one. (The async reader,
    stream_hub.py, starts from it too.)"""
    return as_int((yield from ask(cmd("hget", job_key(job_id), ATTEMPT_FIELD)))) + 1


class AttemptFilter:
    """Applies the reader's rules (module docstring) to entries in stream order."""

    def __init__(self, floor: int) -> None:
        self.attempt = floor  # the attempt whose entries pass
        self.next_seq = 0  # the next text index expected in that attempt
        self.passed_any = False  # something of the current attempt was let through

    def admit(self, ev: StreamEvent) -> list[StreamEvent]:
        """What to yield for one stored entry: nothing, the entry, or a restart then the entry."""
        if ev.attempt < self.attempt:
            return []
        out: list[StreamEvent] = []
        if ev.attempt > self.attempt:
            if self.passed_any:
                out.append(StreamEvent("restart", ev.attempt))
            self.attempt, self.next_seq, self.passed_any = ev.attempt, 0, False
        if ev.kind == "text" and ev.seq is not None:
            if ev.seq < self.next_seq:
                return out  # a re-sent duplicate
            self.next_seq = ev.seq + 1
        self.passed_any = True
        return [*out, ev]


class JobFailed(Exception):
    """The job ended with an error; `.error` is the worker's reason."""

    def __init__(self, job_id: str, error: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(f"job {job_id} failed: {error}")
        self.job_id = job_id
        self.error = error
        self.details = details or {}


class JobRestarted(Exception):
    """The job restarted (its worker died) and the new attempt's text diverges from what
    stream() already yielded; call stream() again for the new attempt's text."""

    def __init__(self, job_id: str, attempt: int, delivered: str) -> None:
        super().__init__(f"job {job_id} restarted (attempt {attempt}); call stream() again for the new text")
        self.job_id = job_id
        self.attempt = attempt
        self.delivered = delivered


class TextDeltas:
    """Turns a job's live events (read_events, or the async reader) into the text deltas that
    `stream()` yields, sync and async alike. A new attempt's text is held back until it passes
    what was already yielded; if it diverges, JobRestarted (see FleetJob.stream)."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.delivered = ""  # text yielded so far
        self.current = ""  # text of the live attempt so far
        self.ended = False

    def feed(self, ev: StreamEvent) -> str:
        """The delta to yield for one event ("" for none); sets `ended` at the final entry.
        Raises JobFailed for an error entry, JobRestarted on a diverging attempt."""
        if ev.kind == "restart":
            self.current = ""
        elif ev.kind == "text":
            self.current += ev.text
            if not (self.current.startswith(self.delivered) or self.delivered.startswith(self.current)):
                raise JobRestarted(self.job_id, ev.attempt, self.delivered)
            return self._advance(self.current)
        elif ev.kind == "error":
            self.ended = True
            raise JobFailed(self.job_id, str((ev.data or {}).get("error")), ev.data)
        else:  # done: the final text may be shorter than the void text yielded before
            self.ended = True
            final = str((ev.data or {}).get("text", self.current))
            if final != self.delivered and not final.startswith(self.delivered):
                raise JobRestarted(self.job_id, ev.attempt, self.delivered)
            return self._advance(final)
        return ""

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.delivered):
            return ""
        delta = text[len(self.delivered):]
        self.delivered = text
        return delta


def read_events(
    redis: Redis, job_id: str, *, block_ms: int = 1000, deadline: float | None = None
) -> Iterator[StreamEvent]:
    """The job's live events from the start, blocking for new ones, until done/error.

    Riding out Redis outages: reads are retried on a backoff, resuming after the last entry read.
    Returns without a final event only when `deadline` (time.monotonic()) passes.
    """
    key = stream_key(job_id)
    backoff = Backoff()
    try:
        filt = AttemptFilter(retry_outage(lambda: live_attempt(redis, job_id), deadline, backoff))
    except OUTAGE_ERRORS:
        if _passed(deadline):
            return  # Redis stayed away until the deadline: the caller reports a timeout
        raise
    last = "0-0"
    void_below = 0  # attempts that RQ's own tools re-ran after their ending
    while True:
        wait_ms = block_ms
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            wait_ms = max(1, min(block_ms, int(left * 1000)))
        try:
            read = functools.partial(redis.xread, {key: last}, block=wait_ms, count=512)
            reply = retry_outage(read, deadline, backoff)
        except OUTAGE_ERRORS:
            if _passed(deadline):
                return
            raise
        backoff.reset()
        streams = cast(XreadReply, reply or [])
        for _key, entries in streams:
            for entry_id, fields in entries:
                last = entry_id.decode()
                ev = decode(fields)
                if ev.attempt < void_below:
                    continue
                if ev.final and ev.attempt >= filt.attempt and _rerun(redis, job_id, deadline, backoff):
                    void_below = ev.attempt + 1  # a re-run's new attempt (claim script) follows
                    continue
                for out in filt.admit(ev):
                    yield out
                    if out.final:
                        return


# RQ statuses of a job that has not ended: a final entry read while the job is in one of these was
# written by an attempt that RQ's own tools re-ran since (`rq requeue`), so it is not the ending.
_NOT_ENDED = {"queued", "started", "deferred", "scheduled"}


def _rerun(redis: Redis, job_id: str, deadline: float | None, backoff: Backoff) -> bool:
    """Final entries, `fleet_final` and the ended status are written in one MULTI, so a final
    entry whose job is not ended though it recorded an ending belongs to an attempt that was
    re-run since."""
    status, final = retry_outage(lambda: redis.hmget(job_key(job_id), ["status", FINAL_FIELD]),
                                 deadline, backoff)
    return as_str(status) in _NOT_ENDED and final is not None


def _passed(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline
