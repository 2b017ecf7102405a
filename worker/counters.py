"""What a worker counts while it serves: written by the loop, read by the heartbeat thread for
`fleet status` (plain attribute updates; a status a few milliseconds stale is fine)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field


@dataclass
class WorkerCounters:
    """Read by the heartbeat thread for `fleet status`."""

    jobs_done: int = 0
    jobs_failed: int = 0
    jobs_requeued: int = 0
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
