"""One reader for many job streams: the asyncio side of dispatcher/stream.py.

An asyncio process (the gateway, an app on asyncio) may follow thousands of jobs at once. Giving
each its own blocking XREAD would cost one Redis connection per open stream. The hub instead runs
one task that XREADs every followed stream in one call and hands each entry to the followers of
that job (their own asyncio queues, with the same attempt rules as the sync reader: its
AttemptFilter, from the same live attempt).

A follower that joins while the task is blocked in XREAD would wait up to `block_ms` for its
first entry. So the hub also reads a private wake stream (fleet:hub:<id>); a joining follower
XADDs to it, and the blocked XREAD returns at once and starts over with the new key. The wake
stream keeps one entry and expires a minute after the last wake.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, cast

from redis.asyncio import Redis

from backends.contract.keys import hub_wake_key, stream_key
from backends.contract.retry import OUTAGE_ERRORS, Backoff, is_outage, retry_outage_async
from backends.contract.stream import StreamEvent, decode
from dispatcher.plans import run_async
from dispatcher.stream import AttemptFilter, XreadReply, live_attempt_plan

log = logging.getLogger("fleet.streams")
WAKE_TTL = 60  # seconds the wake stream outlives the last wake


def entry_order(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id ("ms-seq") as something that sorts like Redis sorts them."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


@dataclass(eq=False)
class Follower:
    """One consumer of one job's stream; the hub puts its admitted events on `queue`."""

    job_id: str
    filter: AttemptFilter
    queue: asyncio.Queue[StreamEvent] = field(default_factory=asyncio.Queue)
    last: tuple[int, int] = (0, 0)  # the last entry read for this follower
    ended: bool = False


class StreamHub:
    def __init__(self, redis: Redis, *, block_ms: int = 1000, count: int = 512) -> None:
        self.redis = redis
        self.block_ms = block_ms
        self.count = count
        self.wake_key = hub_wake_key(uuid.uuid4().hex)
        self._wake_last = b"0-0"
        self._followers: dict[str, list[Follower]] = {}  # by stream key
        self._joined = asyncio.Event()
        self._reading = False  # an XREAD is in flight
        self._task: asyncio.Task[None] | None = None

    @property
    def following(self) -> int:
        """Open streams (followers) right now."""
        return sum(len(f) for f in self._followers.values())

    async def events(self, job_id: str, deadline: float | None = None) -> AsyncIterator[StreamEvent]:
        """The job's live events from its first entry until done/error, as read_events() yields
        them; returns early when `deadline` (time.monotonic()) passes."""
        backoff = Backoff()

        def live_attempt() -> Awaitable[int]:
            return run_async(self.redis, live_attempt_plan(job_id))

        try:
            floor = await retry_outage_async(live_attempt, deadline, backoff)
        except OUTAGE_ERRORS:
            if deadline is not None and time.monotonic() >= deadline:
                return  # Redis stayed away until the deadline: the caller reports a timeout
            raise
        follower = Follower(job_id, AttemptFilter(floor))
        await self._join(follower)
        try:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                try:
                    ev = await asyncio.wait_for(follower.queue.get(), left)
                except TimeoutError:
                    return
                yield ev
                if ev.final:
                    return
        finally:
            self._leave(follower)

    async def _join(self, follower: Follower) -> None:
        self._followers.setdefault(stream_key(follower.job_id), []).append(follower)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="fleet-stream-hub")
        self._joined.set()
        if self._reading:  # the XREAD in flight lacks this key: end it now
            with contextlib.suppress(*OUTAGE_ERRORS):  # an outage ends that XREAD anyway
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.xadd(self.wake_key, {"w": 1}, maxlen=1)
                    pipe.expire(self.wake_key, WAKE_TTL)
                    await pipe.execute()

    def _leave(self, follower: Follower) -> None:
        key = stream_key(follower.job_id)
        group = self._followers.get(key, [])
        if follower in group:
            group.remove(follower)
        if not group:
            self._followers.pop(key, None)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        backoff = Backoff()
        while True:
            if not self._followers:
                self._joined.clear()
                await self._joined.wait()
                continue
            # each stream from the oldest position any of its followers still needs
            streams: dict[Any, Any] = {
                key: "{}-{}".format(*min(f.last for f in group)) for key, group in self._followers.items()
            }
            streams[self.wake_key] = self._wake_last
            self._reading = True
            try:
                reply = await self.redis.xread(streams, block=self.block_ms, count=self.count)
            except OUTAGE_ERRORS as e:
                if not is_outage(e):
                    log.error("stream reader: %s", e)
                await asyncio.sleep(backoff.next())
                continue
            finally:
                self._reading = False
            backoff.reset()
            self._dispatch(cast(XreadReply, reply or []))

    def _dispatch(self, reply: XreadReply) -> None:
        for raw_key, entries in reply:
            key = raw_key.decode()
            if key == self.wake_key:
                self._wake_last = entries[-1][0] if entries else self._wake_last
                continue
            for entry_id, fields in entries:
                order = entry_order(entry_id)
                for follower in list(self._followers.get(key, [])):
                    if order <= follower.last or follower.ended:
                        continue
                    follower.last = order
                    try:
                        event = decode(fields)
                    except (KeyError, ValueError) as e:  # not written by a fleet worker: skip it
                        log.warning("stream %s: unreadable entry %r: %s", key, entry_id, e)
                        continue
                    for ev in follower.filter.admit(event):
                        follower.queue.put_nowait(ev)
                        if ev.final:
                            follower.ended = True
                            self._leave(follower)
                            break
