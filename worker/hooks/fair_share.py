"""The fair share's correction (a hook: worker/hooks/__init__.py): a job that ends with a result
moves its tenant's counter from what the claim charged (its estimate) to what it was served,
prompt, cached and generated tokens at their weights, in the ending's MULTI
(backends/contract/queue/fair.py). A job that failed keeps the estimate."""

from __future__ import annotations

from typing import TYPE_CHECKING

from redis.client import Pipeline

from backends.contract.gateway_settings import FairTokens
from backends.contract.queue import split_queue
from backends.contract.queue.fair import FAIR_CORRECT, correct_call, served
from worker.hooks import EndingHook

if TYPE_CHECKING:
    from worker.hooks import Holder
    from worker.job import ClaimedJob, Ending


class FairShare(EndingHook):
    def __init__(self, weights: FairTokens | None = None) -> None:
        self.weights = weights or FairTokens()

    def on_end(self, job: ClaimedJob, ending: Ending, holder: Holder, pipe: Pipeline) -> None:
        if ending.result is None:
            return
        # the tenant whose turns it took: its queue's (a plain RQ job naming a tenant on the pool's
        # own queue took the default tenant's)
        base, tenant = split_queue(job.origin or job.queue)
        real = served(ending.result.get("usage") or {}, self.weights)
        keys, args = correct_call(job.id, base, tenant, real)
        pipe.eval(FAIR_CORRECT, len(keys), *keys, *args)
