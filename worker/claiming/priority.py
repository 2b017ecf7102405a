"""Which priorities a worker may claim into its free slots: slots are kept in reserve for
interactive (high and default priority) jobs, so a batch of long low-priority jobs never holds
every slot and an interactive job starts at the next step (docs/batch.md, "Priorities").

Reserve, not preemption: a preempted sequence would lose its KV (or its slot's kept KV) and redo
its prompt, and the worker would need a resume path; a reserve costs the batch `reserved / slots`
of the fleet's width, measured in docs/batch.md. Besides the fixed reserve, slots that interactive
jobs used in the last `window` seconds stay theirs, so users who pause between requests find
their slots free instead of waiting for low jobs to finish.

Beside interactive work, low jobs also get a bounded share of each decode step: at most
`batch_share` low jobs per interactive job of the recent peak. A step's time grows with its rows
(every row pays the output layer), and a newcomer's time to first token is about one step, so
8 interactive rows plus 6 batch rows made TTFT ~1.9x the idle fleet's; with 0.5 the step holds at
most 1.5x the interactive rows. Once the peak window passes, the batch has every unreserved slot.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence

LOW = "low"
PEAK_WINDOW = 30.0  # seconds an interactive peak keeps its slots away from low jobs
BATCH_SHARE = 0.5  # low jobs per interactive job while interactive work runs (default)


def auto_reserved(slots: int) -> int:
    """Default reserve: 1 slot in 8 (2 of 16), at least 1 from 4 slots, none below."""
    return 0 if slots < 4 else max(1, slots // 8)


def claim_limits(priorities: Sequence[str], free: int, slots: int, low_in_flight: int, reserved: int,
                 interactive_peak: int = 0, batch_share: float = BATCH_SHARE) -> list[int]:
    """Per queue (claim order, highest first): the most jobs one claim may hold once it has taken
    from that queue. High and default may fill every free slot; low jobs may only occupy
    slots - reserved - interactive_peak in total (the peak: interactive jobs recently in flight),
    and while there is a peak, at most batch_share of it (at least one)."""
    low_cap = slots - reserved - interactive_peak
    if interactive_peak:
        low_cap = min(low_cap, max(1, round(interactive_peak * batch_share)))
    low_room = max(0, low_cap - low_in_flight)
    limits = []
    for priority in priorities:
        limits.append(free if priority != LOW else min(free, low_room))
    return limits


class ClaimPolicy:
    """claim_limits plus the one piece of state it needs: the recent interactive peak."""

    def __init__(self, slots: int, reserved: int | None, queues: Sequence[str], window: float = PEAK_WINDOW,
                 batch_share: float = BATCH_SHARE):
        self.slots = slots
        self.batch_share = batch_share
        self.reserved = auto_reserved(slots) if reserved is None else min(reserved, slots)
        self.priorities = [q.rsplit(":", 1)[-1] for q in queues]
        self.window = window
        self._seen: deque[tuple[float, int]] = deque()  # (time, interactive jobs in flight)

    def limits(self, free: int, held_queues: Iterable[str], now: float | None = None) -> list[int]:
        held = [q.rsplit(":", 1)[-1] for q in held_queues]
        low = sum(p == LOW for p in held)
        return claim_limits(self.priorities, free, self.slots, low, self.reserved,
                            self._peak(len(held) - low, time.monotonic() if now is None else now),
                            self.batch_share)

    def _peak(self, interactive: int, now: float) -> int:
        while self._seen and self._seen[0][0] < now - self.window:
            self._seen.popleft()
        while self._seen and self._seen[-1][1] <= interactive:
            self._seen.pop()  # a later, larger value makes older smaller ones irrelevant
        self._seen.append((now, interactive))
        return self._seen[0][1]
