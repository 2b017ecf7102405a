"""A violation names its invariant. The invariants, in the order the report lists them:"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

INVARIANTS = {
    "fleet_quiet": "once traffic stops, every queue and in-flight list drains and every batch ends (bounded)",
    "ended_once": "every accepted job ended exactly once: one final stream entry and one RQ result",
    "batch_lines": "every line of every batch ended exactly once, and the batch with them",
    "told_clearly": "every client was told clearly: a final answer, a 4xx with a message, or an error event",
    "no_5xx": "no 5xx, except the documented 503 while Redis is down and 504 on the short-timeout path",
    "no_hang": "no client waited past its deadline (a stream included)",
    "bad_input_refused": "bad input is refused with a 4xx",
    "processes": "every process not killed is alive; every killed one came back and serves",
    "tenant_limits": "a tenant never has more jobs in flight than max_concurrent, nor waiting than "
                     "max_queued",
    "tenant_usage": "a tenant's usage counts equal the sum of its ended jobs' results",
    "tenant_rates": "a tenant's per-minute counters equal what its jobs admitted and used in that minute",
    "key_ttl": "every key has a TTL, except the live fleet's fixed set (ecosystem/local/fleet_keys.py)",
    "queue_model": "the queue model's invariants (backends/contract/queue/invariants.py)",
    "faults_ran": "every fault of the plan ran and its target recovered",
}


@dataclass(frozen=True)
class Violation:
    invariant: str  # a key of INVARIANTS
    detail: str
    at: float | None = None  # seconds into the run, for what was seen while it ran

    def as_dict(self) -> dict[str, Any]:
        return {"invariant": self.invariant, "detail": self.detail, "at": self.at}

    def __str__(self) -> str:
        when = f" (at {self.at:.1f}s)" if self.at is not None else ""
        return f"{self.invariant}: {self.detail}{when}"
