"""Embedding jobs in the worker: claimed, started and ended like any job (same queues, tenants,
fenced writes, crash safety), but run here instead of in the engine's generation slots.

The loop hands each started embedding job to `EmbedQueue.add` and calls `step()` once per turn,
before the engine's own step: it embeds the next `embed_batch` waiting inputs (of one job or
several, oldest first: a job's inputs may span turns, and many one-input requests share a
decode) and returns the events the loop already knows: `Done` (the vectors in `extra`) or
`Failed`. So generation runs between embedding batches, and a waiting embedding job holds one of
the worker's slots (the claim counts it), which bounds how many are taken.

Vectors are cut to the request's `dimensions` and normalised here (backends/contract/embed.py),
whichever engine pooled them.

Text jobs (tokenize, detokenize, apply-template) run on a thread of their own:
worker/serving/text_jobs.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from backends.base import (
    BackendUnavailable,
    Done,
    Embedder,
    Event,
    Failed,
    InputRejected,
    JobRejected,
)
from backends.contract.embed import REJECTED, EmbedRequest, encode_vector, finish_vector

log = logging.getLogger("fleet.worker")


class _Queued(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def tokens(self) -> int: ...  # counted so far (a cancelled job's usage)


J = TypeVar("J", bound=_Queued)


@dataclass
class _Job:
    id: str
    request: EmbedRequest
    embedder: Embedder  # the engine of its model (a catalogue worker holds several)
    vectors: list[str] = field(default_factory=list)  # encoded, in input order
    tokens: int = 0
    taken: int = 0  # inputs handed to the engine so far


class StepQueue(Generic[J]):
    """Jobs the loop runs between the engine's steps, oldest first: what embedding and rerank
    jobs (worker/serving/rerank_jobs.py) share, from the loop's side."""

    def __init__(self) -> None:
        self.jobs: dict[str, J] = {}  # oldest first
        self._ended: list[Event] = []  # cancelled since the last step

    def held(self) -> int:
        return len(self.jobs)

    def step(self) -> list[Event]:
        """The events of this turn: the jobs cancelled since the last, then one engine call's."""
        events, self._ended = self._ended, []
        if self.jobs:
            self._turn(events)
        return events

    def _turn(self, events: list[Event]) -> None:
        raise NotImplementedError

    @staticmethod
    def unable(engine: object, verb: str) -> JobRejected:
        """The worker's setup, not the request: no REJECTED mark."""
        return JobRejected(f"this worker's engine ({getattr(engine, 'name', '?')}) does not {verb}")

    def cancel(self, job_id: str) -> bool:
        """True when it was a job of this queue: it ends cancelled at the next step."""
        job = self.jobs.pop(job_id, None)
        if job is None:
            return False
        self._ended.append(Done(job_id, "cancelled", job.tokens, 0))
        return True

    def _fail_batch(self, events: list[Event], batch: list[tuple[J, int]], reason: str,
                    retryable: bool = False) -> None:
        """Every job with an input in the batch fails, once."""
        for job in {id(j): j for j, _ in batch}.values():
            self._fail(events, job, reason, retryable)

    def _fail(self, events: list[Event], job: J, reason: str, retryable: bool = False) -> None:
        self.jobs.pop(job.id, None)
        events.append(Failed(job.id, reason, retryable=retryable))


class EmbedQueue(StepQueue[_Job]):
    def add(self, job_id: str, request: EmbedRequest, engine: object) -> None:
        """Queue a started job on `engine` (the worker's, or on a catalogue worker its model's);
        JobRejected when that engine cannot embed (the worker's setup, not the request: no
        REJECTED mark)."""
        if not isinstance(engine, Embedder):
            raise self.unable(engine, "embed")
        self.jobs[job_id] = _Job(job_id, request, engine)

    def _turn(self, events: list[Event]) -> None:
        embedder = next(iter(self.jobs.values())).embedder  # the oldest job's model this turn
        batch: list[tuple[_Job, int]] = []  # (job, input index)
        for job in self.jobs.values():
            while (job.embedder is embedder and job.taken < len(job.request.input)
                   and len(batch) < embedder.embed_batch):
                batch.append((job, job.taken))
                job.taken += 1
        try:
            out = embedder.embed([j.request.input[i] for j, i in batch],
                                 [j.request.truncate for j, _ in batch])
        except InputRejected as e:
            job, index = batch[e.index]
            self._fail(events, job, f"{REJECTED}input {index} {e}")
            for other, _ in batch:  # the others' inputs go again next turn
                other.taken = len(other.vectors)
            return
        except (JobRejected, BackendUnavailable) as e:
            self._fail_batch(events, batch, str(e), retryable=isinstance(e, BackendUnavailable))
            return
        except Exception as e:  # a failure of the engine's call must not repeat every turn
            log.exception("embedding failed")
            self._fail_batch(events, batch, f"internal error embedding: {e}")
            return
        for (job, _), emb in zip(batch, out, strict=True):
            if job.id not in self.jobs:
                continue  # failed by an earlier input of this batch
            wanted = job.request.dimensions
            if wanted is not None and wanted > len(emb.vector):
                self._fail(events, job, f"{REJECTED}dimensions {wanted} is more than this model's "
                                        f"{len(emb.vector)}")
                continue
            job.vectors.append(encode_vector(finish_vector(emb.vector, wanted, job.request.normalize)))
            job.tokens += emb.tokens
            if len(job.vectors) == len(job.request.input):
                del self.jobs[job.id]
                events.append(Done(job.id, "stop", job.tokens, 0, extra={
                    "embeddings": job.vectors, "dimensions": wanted or len(emb.vector)}))
