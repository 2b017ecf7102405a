"""What a burst run of the worker loop (`fleet worker --burst`, FleetWorker.run_until_idle) did."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BurstSummary:
    """What `run_until_idle` did: `idle` (False: the timeout passed first), jobs let go of by
    outcome (finished, cancelled, failed, requeued, taken over), and how long it ran."""

    idle: bool
    ended: dict[str, int]
    seconds: float

    @property
    def total(self) -> int:
        return sum(self.ended.values())
