"""The worker's view of its Redis connection, shared by the loop and the heartbeat thread.

While Redis is unreachable the loop keeps generating and buffers its writes; it asks Redis again
only when `ready()` says the backoff has passed, so an outage costs neither a crash loop nor a
busy loop, and the log gets one line when Redis goes away, one every LOG_EVERY seconds while it
stays away, and one when it is back.
"""

from __future__ import annotations

import logging
import threading
import time

from backends.contract.retry import Backoff

log = logging.getLogger("fleet.worker")
LOG_EVERY = 10.0  # seconds between "still unreachable" lines


class RedisLink:
    def __init__(self, first_delay: float = 0.1, max_delay: float = 2.0) -> None:
        self._lock = threading.Lock()
        self._backoff = Backoff(first_delay, max_delay)
        self.up = True
        self.down_since: float | None = None
        self.recovered_at = float("-inf")  # monotonic time of the last down -> up
        self.outages = 0
        self._next_try = 0.0
        self._logged_at = 0.0

    def ready(self) -> bool:
        """Worth talking to Redis now: it is up, or the backoff since the last failure passed."""
        return self.up or time.monotonic() >= self._next_try

    def wait_left(self) -> float:
        """Seconds until the next reconnect attempt (0 when up)."""
        return 0.0 if self.up else max(0.0, self._next_try - time.monotonic())

    def failed(self, error: BaseException, doing: str) -> None:
        now = time.monotonic()
        with self._lock:
            if self.up:
                self.up, self.down_since, self._logged_at = False, now, now
                self.outages += 1
                log.warning("Redis unreachable while %s (%s); generating on, retrying with backoff",
                            doing, _short(error))
            elif now - self._logged_at >= LOG_EVERY:
                self._logged_at = now
                log.warning("Redis still unreachable after %.0fs (%s)", now - (self.down_since or now),
                            _short(error))
            self._next_try = now + self._backoff.next()

    def succeeded(self) -> bool:
        """Record a successful call; True when this ends an outage."""
        if self.up:
            return False
        now = time.monotonic()
        with self._lock:
            if self.up:
                return False
            log.warning("Redis reachable again after %.1fs", now - (self.down_since or now))
            self.up, self.down_since, self.recovered_at = True, None, now
            self._backoff.reset()
            return True

    def since_recovery(self) -> float:
        return time.monotonic() - self.recovered_at


def _short(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:200]
