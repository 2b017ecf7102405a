"""Reading a job's token stream (entries and their codec: backends/contract/stream.py).

What a reader does (read_events):
- The highest attempt wins. Text of a lower attempt is void: a dead attempt's partial text, or a
  straggler that a worker which lost the job during a Redis outage wrote late. When a higher
  attempt shows up after lower-attempt text was read, the reader yields a `restart` event.
- A text entry whose `n` was already read for its attempt is a duplicate (a worker re-sends a batch
  whose acknowledgement was lost when Redis went away) and is skipped.
- A job has exactly one final entry (d or e): workers write it only while they still hold the job
  (worker.claim.commit_held), so a job that was taken over never gets a second one.
A late subscriber reads from the start, so it gets every token.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from typing import cast

from redis import Redis

from backends.contract.keys import ATTEMPT_FIELD, job_key, stream_key
from backends.contract.replies import as_int
from backends.contract.retry import OUTAGE_ERRORS, Backoff, retry_outage
from backends.contract.stream import StreamEvent, decode


def live_attempt(redis: Redis, job_id: str) -> int:
    """The attempt now running (or the last one, if the job ended): entries of earlier attempts
    are void. The job hash counts the attempts before the current one."""
    return as_int(redis.hget(job_key(job_id), ATTEMPT_FIELD)) + 1


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
        streams = cast(list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]], reply or [])
        for _key, entries in streams:
            for entry_id, fields in entries:
                last = entry_id.decode()
                for ev in filt.admit(decode(fields)):
                    yield ev
                    if ev.final:
                        return


def _passed(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline
