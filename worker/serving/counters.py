"""What a worker counts while it serves, and whether its engine is held after a failure: written
by the loop, read by the heartbeat thread for `fleet status` (plain attribute updates; a status a
few milliseconds stale is fine)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from backends.contract.retry import Backoff


@dataclass
class WorkerCounters:
    """Read by the heartbeat thread for `fleet status`."""

    jobs_done: int = 0
    jobs_failed: int = 0
    jobs_requeued: int = 0
    resumed: int = 0  # new attempts that continued the text of a dead one
    preempted: int = 0  # jobs handed back for another tenant's share of the slots
    tokens: int = 0
    state: str = "starting"
    # (time, tokens) of the last steps; appended in place: no copy on the loop's hot path
    recent: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=256))

    def record_step(self, n_tokens: int) -> None:
        self.tokens += n_tokens
        self.recent.append((time.monotonic(), n_tokens))

    def tokens_per_second(self, window: float = 10.0) -> float:
        now = time.monotonic()
        snapshot = list(self.recent)  # one C-level copy: safe while the loop appends
        pts = [(t, n) for t, n in snapshot if now - t <= window]
        if not pts:
            return 0.0
        span = max(now - pts[0][0], 1.0)
        return sum(n for _, n in pts) / span


class EngineHold:
    """Claims paused after an engine failure: until a backoff passes and the engine answers a
    probe. Changed by the loop only; `down` may be read from any thread (the heartbeat's
    `backend_health`): it reads one float, which the loop replaces whole."""

    def __init__(self) -> None:
        self._backoff = Backoff(1.0, 30.0)
        self._until = 0.0  # time.monotonic() to wait for; 0.0: not held

    @property
    def down(self) -> bool:
        return self._until != 0.0

    def seconds_left(self) -> float:
        return self._until - time.monotonic()

    def failed(self) -> None:
        """The engine failed a job: one step back, whatever the number of jobs one incident fails."""
        if time.monotonic() >= self._until:
            self._until = time.monotonic() + self._backoff.next()

    def served(self) -> None:
        """The engine finished a job: the next failure starts the backoff from the beginning."""
        self._backoff.reset()

    def ready(self, probe: Callable[[], bool]) -> bool:
        """Claim again only once the backoff passed and the engine answers `probe`."""
        if time.monotonic() < self._until:
            return False
        if self._until and not probe():
            self._until = time.monotonic() + self._backoff.next()
            return False
        self._until = 0.0
        return True
