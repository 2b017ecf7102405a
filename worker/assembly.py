"""Which hooks (worker/hooks/__init__.py) a worker's writes carry: one line per concern.

`fleet worker` (worker/main.py) and the in-process worker (worker/inprocess.py) are built with
these; a FleetWorker or Reaper made without hooks gets them too, so every way of making a worker
writes the same records.
"""

from __future__ import annotations

from worker.hooks import JobHook
from worker.hooks.batch_hook import BatchRecord
from worker.hooks.facts import Facts
from worker.hooks.fair_share import FairShare
from worker.hooks.held_prefixes import HeldPrefixes
from worker.hooks.tenant_usage import TenantUsage
from worker.settings import FleetSettings


def job_hooks(settings: FleetSettings | None = None) -> tuple[JobHook, ...]:
    """The hooks, in the order they queue (`settings` None: every concern on, as by default)."""
    hooks: list[JobHook] = [BatchRecord(),  # a batch line's ending into its batch's record
                            TenantUsage(),  # admission places let go, usage counted
                            FairShare(settings.gateway.fair_tokens if settings else None),  # charge corrected
                            HeldPrefixes()]  # where the job's prefixes are: its next turn comes here
    if settings is None or settings.observe:
        hooks.append(Facts())  # counters, histograms, job history (`observe: false` turns it off)
    return tuple(hooks)
