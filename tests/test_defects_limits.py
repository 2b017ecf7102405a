"""Request size is bounded before decompressing and before tokenizing, by the
worker's context budget; such jobs fail at once (attempt 1, no retry) and the worker serves on.
The producer bounds a request's total text too. In-process workers, real redis-server."""

from __future__ import annotations

import json
import zlib

import pytest
from redis import Redis

from backends.contract.keys import JOB_FUNCTION, job_key
from backends.fake import FakeBackend
from dispatcher import Fleet, JobFailed
from tests.lossy import inproc_worker, run_until, worker_client
from tests.reliability_checks import final_entries
from worker.serving.loop import FleetWorker
from worker.settings import FleetSettings

pytestmark = pytest.mark.timeout(120)


def test_a_payload_that_inflates_past_the_budget_is_refused_before_inflating(redis_url: str,
                                                                             redis: Redis) -> None:
    """20 MB of JSON in a 20 KB zlib entry (a legit job's payload swapped for it)."""
    fleet = Fleet(redis_url)
    bomb = fleet.submit(prompt="placeholder", max_tokens=2)
    huge = json.dumps([JOB_FUNCTION, None, [{"prompt": "a" * 20_000_000}], {}]).encode()
    redis.hset(job_key(bomb.id), "data", zlib.compress(huge, 9))
    after = fleet.submit(prompt="still serving", max_tokens=4)
    fw = inproc_worker(redis_url, "z1")
    run_until([fw], lambda: final_entries(redis, after.id), what="the next job")
    with pytest.raises(JobFailed) as failed:
        bomb.result(timeout=1)
    assert failed.value.error.startswith("refused: request too large: the payload inflates to more than")
    assert failed.value.details["attempt"] == 1
    assert after.result(timeout=1)["text"] == "still serving"


def test_a_request_longer_than_the_context_allows_fails_before_tokenizing(redis_url: str,
                                                                           redis: Redis) -> None:
    """A llama.cpp worker with 256 tokens per job takes at most 256 x 32 characters."""
    engine = {"type": "llama-cpp", "n_ctx_per_seq": 256}
    settings = FleetSettings(redis_url=redis_url, name="ctx1", backend=engine)
    backend = FakeBackend(slots=2)  # stands in for the engine: the limit applies before it
    fw = FleetWorker(settings, backend, worker_client(redis_url), "ctx1")
    job = Fleet(redis_url).submit(messages=[{"role": "user", "content": "word " * 2000}], max_tokens=4)
    run_until([fw], lambda: final_entries(redis, job.id), what="the refusal")
    with pytest.raises(JobFailed) as failed:
        job.result(timeout=1)
    assert failed.value.error == ("refused: request too large: 10,000 characters; this worker takes at most "
                                  "8,192 characters (a context of 256 tokens x 32 characters per token)")
    assert job.id not in backend.admitted


def test_the_producer_bounds_all_messages_together() -> None:
    fleet = Fleet("redis://127.0.0.1:1/0")  # never reached: validation comes first
    messages = [{"role": "user", "content": "x" * 600_000}, {"role": "user", "content": "y" * 600_000}]
    expected = "holds 1,200,000 characters together; the limit is 1,000,000"
    with pytest.raises(ValueError, match=expected):
        fleet.submit(messages=messages)
