"""What the loop writes for a job: its text deltas, and its one final entry with the RQ
bookkeeping that goes with it. Pure pipeline writers; when and whether they run (only while the
worker still holds the job) is the loop's business (worker/loop.py, worker/claim.py)."""

from __future__ import annotations

import logging
from typing import Any

from redis.client import Pipeline

from backends.base import Done
from backends.contract import stream
from backends.contract.keys import ATTEMPT_FIELD, cancel_key, job_key, stream_key
from backends.contract.schema import job_result
from worker import rqjobs
from worker.rqjobs import ClaimedJob

log = logging.getLogger("fleet.worker")


def result_of(job: ClaimedJob, done: Done, now: float, worker: str, backend: str) -> dict[str, Any]:
    """The result job.result() returns, as the plain dict RQ stores (schema: JobResult)."""
    queue_ms = (job.claimed_at - job.enqueued_at) * 1000 if job.enqueued_at else None
    ttft_ms = (job.first_token_at - job.claimed_at) * 1000 if job.first_token_at else None
    gen_s = now - job.first_token_at if job.first_token_at else 0.0
    return job_result(
        job.id, "".join(job.text), done.finish_reason, prompt_tokens=done.prompt_tokens,
        completion_tokens=done.completion_tokens, worker=worker,
        backend=str(done.extra.get("backend", backend)), attempt=job.attempt, queue_ms=queue_ms,
        ttft_ms=ttft_ms, total_ms=(now - job.claimed_at) * 1000,
        tokens_per_s=done.completion_tokens / gen_s if gen_s > 0 else None,
    ).model_dump()


def write_text(job: ClaimedJob, pipe: Pipeline) -> int:
    """Queue the job's unsent deltas (numbered, so a re-send after a lost reply is recognised as
    a duplicate). Returns how many; the caller marks them sent once the pipeline succeeded."""
    if job.attempt_dirty:  # the engine restarted it: the new attempt number goes first
        pipe.hset(job_key(job.id), ATTEMPT_FIELD, job.attempt - 1)
    for i, text in enumerate(job.unsent):
        pipe.xadd(stream_key(job.id), stream.encode_text(job.attempt, job.sent + i, text),
                  maxlen=stream.STREAM_MAXLEN, approximate=True)
    return len(job.unsent)


def mark_text_sent(job: ClaimedJob, count: int) -> None:
    del job.unsent[:count]
    job.sent += count
    job.attempt_dirty = False


def write_ending(job: ClaimedJob, pipe: Pipeline, worker: str, backend: str, result_ttl: int) -> None:
    """Queue the job's final entry and RQ's record of it (inside the caller's MULTI)."""
    ending = job.ending
    assert ending is not None
    if ending.result is not None:
        try:
            rqjobs.store_success(job, ending.result, worker, result_ttl, pipe)
        except Exception:  # the producer's result matters more than RQ's registries
            log.exception("job %s: RQ success bookkeeping failed; result still delivered", job.id)
            pipe.hset(job_key(job.id), "status", "finished")
        entry = stream.encode_done(job.attempt, ending.result)
    else:
        reason = ending.error or "failed"
        rqjobs.store_failure(job, reason, worker, result_ttl, pipe)
        entry = stream.encode_error(job.attempt, rqjobs.error_payload(reason, job, worker, backend))
    key = stream_key(job.id)
    pipe.xadd(key, entry, maxlen=stream.STREAM_MAXLEN, approximate=True)
    pipe.expire(key, result_ttl)
    pipe.delete(cancel_key(job.id))


def write_refusal(raw_id: bytes, queue: str, reason: str, worker: str, result_ttl: int,
                  pipe: Pipeline) -> None:
    """A claimed id that is not text (no RQ producer makes one): failed under its raw bytes."""
    printable = raw_id.decode("utf-8", "backslashreplace")
    rqjobs.store_plain_failure(job_key("").encode() + raw_id, raw_id, queue, reason, result_ttl, pipe)
    err = {"job_id": printable, "error": reason, "worker": worker, "backend": "", "attempt": 1}
    key = stream_key("").encode() + raw_id
    pipe.xadd(key, stream.encode_error(1, err))
    pipe.expire(key, result_ttl)
