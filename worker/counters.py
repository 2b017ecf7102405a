"""What a worker counts while it serves: written by the loop, read by the heartbeat thread for
`fleet status` (plain attribute updates; a status a few milliseconds stale is fine)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class WorkerCounters:
    """Read by the heartbeat thread for `fleet status`."""

    jobs_done: int = 0
    jobs_failed: int = 0
    jobs_requeued: int = 0
    tokens: int = 0
    state: str = "starting"
    recent: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) per step

    def tokens_per_second(self, window: float = 10.0) -> float:
        now = time.monotonic()
        pts = [(t, n) for t, n in self.recent if now - t <= window]
        if not pts:
            return 0.0
        span = max(now - pts[0][0], 1.0)
        return sum(n for _, n in pts) / span
