"""What the loop writes for a job: its text deltas, and its one final entry with the RQ
bookkeeping that goes with it. Pure pipeline writers; when and whether they run (only while the
worker still holds the job) is the loop's business (worker/loop.py, worker/claim.py)."""

from __future__ import annotations

import logging
from typing import Any

from redis.client import Pipeline
from redis.commands.core import Script

from backends.base import Done
from dispatcher import stream
from dispatcher.keys import (
    ATTEMPT_FIELD,
    FINAL_FIELD,
    OWNER_FIELD,
    cancel_key,
    executions_key,
    job_key,
    results_key,
    stream_key,
)
from worker import batch_hook, facts, rqjobs
from worker.rqjobs import ClaimedJob

log = logging.getLogger("fleet.worker")


def result_of(job: ClaimedJob, done: Done, now: float, worker: str, backend: str) -> dict[str, Any]:
    """The result object job.result() returns (and RQ stores as the return value)."""
    waited = job.claimed_ms is not None and job.enqueued_ms is not None
    queue_ms = float(job.claimed_ms - job.enqueued_ms) if waited else None  # type: ignore[operator]
    ttft_ms = (job.first_token_at - job.claimed_at) * 1000 if job.first_token_at else None
    total_s = now - job.claimed_at
    gen_s = now - job.first_token_at if job.first_token_at else 0.0
    return {
        "job_id": job.id,
        "text": "".join(job.text),
        "finish_reason": done.finish_reason,
        "usage": {
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
        },
        "worker": worker,
        "backend": str(done.extra.get("backend", backend)),
        "attempt": job.attempt,
        "timings": {
            "queue_ms": _round(queue_ms),
            "ttft_ms": _round(ttft_ms),
            "total_ms": _round(total_s * 1000),
            "tokens_per_s": _round(done.completion_tokens / gen_s if gen_s > 0 else None),
        },
        # per-token log-probabilities, when the request asked and the engine gave them
        **({"logprobs": done.extra["logprobs"]} if done.extra.get("logprobs") else {}),
    }


def write_text(job: ClaimedJob, pipe: Pipeline, script: Script, worker: str) -> int:
    """Queue the job's unsent deltas (numbered, so a re-send after a lost reply is recognised as
    a duplicate), written only while `worker` owns the job (worker/claim.py's _WRITE_TEXT; an
    engine restart's new attempt number goes first and never lowers the stored one). Returns how
    many; the caller marks them sent once the pipeline succeeded."""
    if not job.unsent and not job.attempt_dirty:
        return 0
    args: list[Any] = [worker, OWNER_FIELD, ATTEMPT_FIELD, job.attempt, job.sent, stream.STREAM_MAXLEN,
                       *job.unsent]
    script(keys=[job_key(job.id), stream_key(job.id)], args=args, client=pipe)
    if job.attempt_dirty:
        facts.record_restart(pipe, job.id, job.queue, job.attempt - 1, job.restart_reason, "engine")
    return len(job.unsent)


def mark_text_sent(job: ClaimedJob, count: int) -> None:
    del job.unsent[:count]
    job.sent += count
    job.attempt_dirty = False


def honour_rq_cancel(job: ClaimedJob, status: str | None) -> None:
    """RQ's job.cancel() on a running job: it ends cancelled, never `finished` (defect 4)."""
    ending = job.ending
    if status == "canceled" and ending is not None and ending.result is not None:
        ending.result["finish_reason"] = "cancelled"


def expire_job(pipe: Pipeline, job_id: str, attempt: int, ttl: int) -> None:
    """A job's final write: everything kept about it expires with its result (defect 1)."""
    key = job_key(job_id)
    pipe.hset(key, FINAL_FIELD, attempt)
    pipe.expire(key, ttl)
    pipe.expire(results_key(job_id), ttl)
    pipe.expire(stream_key(job_id), ttl)
    pipe.expire(executions_key(job_id), ttl)
    pipe.delete(cancel_key(job_id))


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
    pipe.xadd(stream_key(job.id), entry, maxlen=stream.STREAM_MAXLEN, approximate=True)
    expire_job(pipe, job.id, job.attempt, result_ttl)
    batch_hook.record_ending(job, pipe)  # a batch line: its result into the batch's record
    facts.record_end(job, pipe, worker, backend, result_ttl)


def write_refusal(raw_id: bytes, queue: str, reason: str, worker: str, result_ttl: int,
                  pipe: Pipeline) -> None:
    """A claimed id that is not text (no RQ producer makes one): failed under its raw bytes."""
    printable = raw_id.decode("utf-8", "backslashreplace")
    rqjobs.store_plain_failure(job_key("").encode() + raw_id, raw_id, queue, reason, result_ttl, pipe)
    err = {"job_id": printable, "error": reason, "worker": worker, "backend": "", "attempt": 1}
    key = stream_key("").encode() + raw_id
    pipe.xadd(key, stream.encode_error(1, err))
    pipe.expire(key, result_ttl)


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)
