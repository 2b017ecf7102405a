"""The worker's one hook for batches: a batch line's ending is copied into its batch's record in
the same MULTI as the job's final entry (dispatcher/batch/record.py), so it is recorded exactly
once and outlives the job's own result (result_ttl). Jobs that are not batch lines cost one
string prefix test."""

from __future__ import annotations

import time

from redis.client import Pipeline

from backends.contract.keys import BATCH_JOB_PREFIX
from dispatcher.batch.record import record_end
from worker.rqjobs import ClaimedJob


def record_ending(job: ClaimedJob, pipe: Pipeline) -> None:
    if job.ending is None or not job.id.startswith(BATCH_JOB_PREFIX):
        return
    result = job.ending.result
    error = None if result is not None else (job.ending.error or "failed")
    record_end(pipe, job.id, result, error, time.time())
