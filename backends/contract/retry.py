"""Waiting on something that is away for now: which Redis errors mean "away", and the one
exponential backoff every retry in the project uses (Redis reconnects of producers and workers,
HTTP engines coming up, a fallback chain resting a failed backend).

Clients (connect.py `redis_from_url`) do not retry by themselves, so a failed call returns at
once and the caller decides: producers retry until their own deadline, workers keep generating
and retry their writes on a backoff (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import AuthenticationError, AuthorizationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

T = TypeVar("T")

# Connection refused or reset, a read timeout, LOADING while Redis replays its AOF: all pass.
OUTAGE_ERRORS: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError)


def is_outage(error: BaseException) -> bool:
    """True for errors that go away when Redis comes back. A wrong password or a missing ACL
    permission is a configuration error: retrying it only hides it."""
    config_error = isinstance(error, AuthenticationError | AuthorizationError)
    return isinstance(error, OUTAGE_ERRORS) and not config_error


class Backoff:
    """Exponential delays between attempts: first, 2*first, 4*first, ... capped at `cap`.

    `next()` walks the sequence (and `reset()` starts it again); `delay(n)` is the n-th delay
    for callers that count failures themselves."""

    def __init__(self, first: float = 0.1, cap: float = 2.0) -> None:
        self.first = first
        self.cap = cap
        self.attempts = 0

    def delay(self, n: int) -> float:
        """The delay after the n-th consecutive failure (n >= 1; 0 or less reads as 1)."""
        return float(min(self.cap, self.first * 2 ** min(max(0, n - 1), 60)))  # no float overflow

    def next(self) -> float:
        self.attempts += 1
        return self.delay(self.attempts)

    def reset(self) -> None:
        self.attempts = 0


def retry_outage(call: Callable[[], T], deadline: float | None, backoff: Backoff | None = None) -> T:
    """`call()`, retried on a backoff while Redis is unreachable, until `deadline`
    (time.monotonic(); None: forever). The last outage error is raised at the deadline."""
    backoff = backoff or Backoff()
    while True:
        try:
            return call()
        except OUTAGE_ERRORS as e:
            time.sleep(_delay_or_raise(e, deadline, backoff))


async def retry_outage_async(call: Callable[[], Awaitable[T]], deadline: float | None,
                             backoff: Backoff | None = None) -> T:
    """retry_outage for redis.asyncio calls: `await call()`, sleeping without blocking the loop."""
    backoff = backoff or Backoff()
    while True:
        try:
            return await call()
        except OUTAGE_ERRORS as e:
            await asyncio.sleep(_delay_or_raise(e, deadline, backoff))


def _delay_or_raise(error: Exception, deadline: float | None, backoff: Backoff) -> float:
    """How long to wait before the next try; re-raises `error` when it is no outage or the
    deadline has passed (call only inside its `except` block)."""
    if not is_outage(error):
        raise error
    delay = backoff.next()
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise error
        delay = min(delay, left)
    return delay
