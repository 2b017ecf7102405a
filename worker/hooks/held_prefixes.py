"""The placement concern (a hook: worker/hooks/__init__.py): once a job ends with a result, this worker
says it holds the job's prefixes (backends/contract/affinity.py), so the conversation's next turn
is claimed where its KV is (the queue model's claim.lua). In the same MULTI as the job's final write: only
the worker that wrote the result claims its prefixes. Each claim lasts HELD_TTL and the last
worker to run a prefix takes it over."""

from __future__ import annotations

from typing import TYPE_CHECKING

from redis.client import Pipeline

from backends.contract.affinity import HELD_TTL, held_key, held_keys
from backends.contract.schema import GenerateRequest
from worker.hooks import EndingHook

if TYPE_CHECKING:
    from worker.hooks import Holder
    from worker.job import ClaimedJob, Ending


class HeldPrefixes(EndingHook):
    def on_end(self, job: ClaimedJob, ending: Ending, holder: Holder, pipe: Pipeline) -> None:
        result, request = ending.result, job.request
        if not isinstance(request, GenerateRequest) or result is None:
            return  # an embedding job leaves no KV behind
        if result.get("finish_reason") == "cancelled":
            return
        pool = job.queue.rsplit(":", 1)[0]
        for key in held_keys(request, str(result.get("text", ""))):
            pipe.set(held_key(pool, key), holder.worker, ex=HELD_TTL)
