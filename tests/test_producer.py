"""The producer side against a real Redis. Attempts: a dead attempt's text is dropped, a re-sent
delta is read once, a straggler of an old attempt is ignored, and stream() restarts cleanly
(seamlessly when the new attempt repeats the text). Outages: submit() and result() ride out a
Redis restart; a wrong password fails at once instead of being retried."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from redis import Redis
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError

from backends.contract.keys import ATTEMPT_FIELD, job_key, queue_key, stream_key
from backends.contract.stream import encode_done, encode_text
from dispatcher import Fleet, JobRestarted, JobTimeout
from tests.harness import RedisServer
from tests.reliability_checks import start_guarded_redis


def write(redis: Redis, job_id: str, *entries: tuple[int, int, str]) -> None:
    for attempt, seq, text in entries:
        redis.xadd(stream_key(job_id), encode_text(attempt, seq, text))


def done(redis: Redis, job_id: str, attempt: int, text: str) -> None:
    redis.xadd(stream_key(job_id), encode_done(attempt, {"text": text, "attempt": attempt}))


def test_new_attempt_repeating_the_text_continues_seamlessly(redis: Redis, redis_url: str) -> None:
    write(redis, "j1", (1, 0, "Hello"), (1, 1, " wor"), (2, 0, "Hello"), (2, 1, " world"), (2, 2, "!"))
    done(redis, "j1", 2, "Hello world!")
    deltas = list(Fleet(redis_url).job("j1").stream(timeout=5))
    assert deltas == ["Hello", " wor", "ld", "!"]
    kinds = [ev.kind for ev in Fleet(redis_url).job("j1").events(timeout=5)]
    assert kinds == ["text", "text", "restart", "text", "text", "text", "done"]


def test_diverging_attempt_raises_then_a_new_call_reads_only_the_live_attempt(
    redis: Redis, redis_url: str
) -> None:
    job = Fleet(redis_url).job("j2")
    write(redis, "j2", (1, 0, "Once"), (1, 1, " upon"), (2, 0, "In a"), (2, 1, " galaxy"))
    done(redis, "j2", 2, "In a galaxy")
    shown = []
    with pytest.raises(JobRestarted) as restarted:
        for delta in job.stream(timeout=5):
            shown.append(delta)
    assert "".join(shown) == restarted.value.delivered == "Once upon"
    redis.hset(job_key("j2"), ATTEMPT_FIELD, 1)  # what the requeue recorded
    assert "".join(job.stream(timeout=5)) == "In a galaxy" == job.result(timeout=5)["text"]


def test_resent_deltas_and_old_stragglers_are_read_once(redis: Redis, redis_url: str) -> None:
    # a batch re-sent after a lost reply (seq 0-1 twice), then a straggler of attempt 1 written
    # late by a worker that had lost the job
    write(redis, "j3", (2, 0, "A"), (2, 1, "B"), (2, 0, "A"), (2, 1, "B"), (2, 2, "C"), (1, 7, "zzz"))
    done(redis, "j3", 2, "ABC")
    job = Fleet(redis_url).job("j3")
    assert "".join(job.stream(timeout=5)) == "ABC"
    assert job.result(timeout=5) == {"text": "ABC", "attempt": 2}


def test_result_waits_out_a_missing_stream_until_its_timeout(redis_url: str) -> None:
    with pytest.raises(JobTimeout):
        Fleet(redis_url).job("never-submitted").result(timeout=0.5)


def test_submit_and_result_ride_out_a_redis_restart(tmp_path: Path) -> None:
    with RedisServer.start(tmp_path / "redis", extra=["--appendonly", "yes"]) as server:
        fleet = Fleet(server.url, retry_for=20)
        first = fleet.submit(prompt="before the outage")
        server.stop()
        threading.Timer(1.5, server.restart).start()
        started = time.monotonic()
        second = fleet.submit(prompt="during the outage")  # retried until Redis is back
        assert time.monotonic() - started >= 1.0
        redis = server.client()
        assert redis.lrange(queue_key("llm:default"), 0, -1) == [first.id.encode(), second.id.encode()]
        waiter = threading.Thread(target=lambda: results.append(second.result(timeout=20)))
        results: list[dict] = []
        waiter.start()
        server.stop()
        time.sleep(1)
        server.restart()
        done(redis, second.id, 1, "after the outage")
        waiter.join(20)
        assert results == [{"text": "after the outage", "attempt": 1}]


def test_submit_gives_up_after_retry_for(tmp_path: Path) -> None:
    with RedisServer.start(tmp_path / "redis") as server:
        fleet = Fleet(server.url, retry_for=1)
        server.stop()
        started = time.monotonic()
        with pytest.raises(RedisConnectionError):
            fleet.submit(prompt="nobody listens")
        # gave up after its 1 s, not the default 30 s: bounds a loaded box cannot cross
        assert 0.9 <= time.monotonic() - started < 15


def test_wrong_password_is_not_retried(tmp_path: Path) -> None:
    with start_guarded_redis(tmp_path / "redis", ["--requirepass", "right-one"],
                             lambda port: f"redis://:right-one@127.0.0.1:{port}/0") as server:
        fleet = Fleet(f"redis://:wrong-one@127.0.0.1:{server.port}/0", retry_for=30)
        started = time.monotonic()
        with pytest.raises(AuthenticationError):
            fleet.submit(prompt="let me in")
        assert time.monotonic() - started < 15  # at once, not after retrying for its 30 s
