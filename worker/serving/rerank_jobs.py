"""Rerank jobs in the worker: claimed, started and ended like any job, run between the engine's
steps as embedding jobs are (worker/serving/embed_jobs.py). Each `step()` hands the next
`score_batch` documents of the oldest job to one call of its engine, which scores those that fit
one bounded pass (the rest go again next turn: generation runs between); a job's documents in
calls in a row share its query's prefix (the engine keeps it), so a request of many documents
prefills that prefix once.

The result: `scores` in document order, `rerank` with the prefix's and each document's tokens
and the tokens prefilled; usage counts every token of every document's prompt, and as
`cached_tokens` the prefix's tokens documents reused instead of prefilling
(backends/contract/rerank.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from backends.base import BackendUnavailable, Done, Event, InputRejected, JobRejected, Scorer
from backends.contract.rerank import REJECTED, RerankRequest
from worker.serving.embed_jobs import StepQueue

log = logging.getLogger("fleet.worker")


@dataclass
class _Job:
    id: str
    request: RerankRequest
    scorer: Scorer  # the engine of its model (a catalogue worker holds several)
    scores: list[float] = field(default_factory=list)  # in document order
    document_tokens: list[int] = field(default_factory=list)
    prefix_tokens: int = 0
    prefilled: int = 0

    @property
    def tokens(self) -> int:
        """Every token of the documents' prompts so far, the prefix counted for each document."""
        return self.prefix_tokens * len(self.scores) + sum(self.document_tokens)


class RerankQueue(StepQueue[_Job]):
    def add(self, job_id: str, request: RerankRequest, engine: object) -> None:
        """Queue a started job on `engine`; JobRejected when that engine cannot score."""
        if not isinstance(engine, Scorer):
            raise self.unable(engine, "rerank")
        self.jobs[job_id] = _Job(job_id, request, engine)

    def _turn(self, events: list[Event]) -> None:
        job = next(iter(self.jobs.values()))
        request, done = job.request, len(job.scores)
        documents = request.documents[done:done + job.scorer.score_batch]
        try:
            out = job.scorer.score(request.query, request.instruction, documents)
        except InputRejected as e:
            what = "the query" if e.index < 0 else f"document {done + e.index}"
            self._fail(events, job, f"{REJECTED}{what} {e}")
            return
        except (JobRejected, BackendUnavailable) as e:
            self._fail(events, job, str(e), retryable=isinstance(e, BackendUnavailable))
            return
        except Exception as e:  # a failure of the engine's call must not repeat every turn
            log.exception("rerank scoring failed")
            self._fail(events, job, f"internal error scoring documents: {e}")
            return
        job.scores += out.relevance
        job.document_tokens += out.tokens
        job.prefix_tokens = out.prefix_tokens
        job.prefilled += out.prefilled
        if len(job.scores) == len(request.documents):
            del self.jobs[job.id]
            events.append(Done(job.id, "stop", job.tokens, 0, cached_tokens=job.tokens - job.prefilled,
                               extra={"scores": job.scores, "rerank": {
                                   "prefix_tokens": job.prefix_tokens, "document_tokens": job.document_tokens,
                                   "prefilled_tokens": job.prefilled}}))
