"""The batch concern (a hook: worker/hooks/__init__.py): a batch line's ending is copied into its batch's
record in the same MULTI as the job's final entry (backends/contract/batch/line_record.py), so
it is recorded exactly once and outlives the job's own result (result_ttl). Jobs that are not
batch lines cost one string prefix test."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from redis.client import Pipeline

from backends.contract.batch.line_record import record_end
from backends.contract.keys import BATCH_JOB_PREFIX
from worker.hooks import EndingHook

if TYPE_CHECKING:
    from worker.hooks import Holder
    from worker.job import ClaimedJob, Ending


class BatchRecord(EndingHook):
    """A batch line's record changes only when the line ends (a restart is not an ending)."""

    def on_end(self, job: ClaimedJob, ending: Ending, holder: Holder, pipe: Pipeline) -> None:
        if not job.id.startswith(BATCH_JOB_PREFIX):
            return
        result = ending.result
        error = None if result is not None else (ending.error or "failed")
        record_end(pipe, job.id, result, error, time.time())
