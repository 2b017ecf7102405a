"""AsyncFleet on its own, against a real redis-server and a real worker on the real model:
submit/stream/result/cancel, the same attempt rules as the sync reader, many open streams on
one connection, and a job enqueued by AsyncFleet that RQ and the sync API see as their own."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from backends.contract.keys import ATTEMPT_FIELD, job_key, queue_key
from dispatcher import Fleet, JobFailed, JobRestarted
from dispatcher.aio import AsyncFleet
from tests.test_producer import done, write


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.mark.model
def test_submit_stream_result_on_a_real_worker(redis_url: str, workers) -> None:
    workers.start("w1", backend__slots=4)

    async def main() -> tuple[list[str], dict[str, Any], dict[str, Any]]:
        async with AsyncFleet(redis_url) as fleet:
            job = await fleet.submit(prompt="Once upon a time", max_tokens=16, temperature=0.0)
            deltas = [d async for d in job.stream(timeout=60)]
            return deltas, await job.result(timeout=5), await fleet.job(job.id).result(timeout=5)

    deltas, res, again = run(main())
    assert "".join(deltas) == res["text"] == again["text"] and res["text"]
    assert res["usage"]["completion_tokens"] == 16 and res["worker"] == "w1"
    # the sync API reads the same job, and RQ sees a normal finished JSON job
    assert Fleet(redis_url).job(res["job_id"]).result(timeout=5)["text"] == res["text"]
    rq_job = Job.fetch(res["job_id"], connection=Redis.from_url(redis_url), serializer=JSONSerializer)
    assert rq_job.get_status() == "finished" and rq_job.origin == "llm:default"


@pytest.mark.model
def test_concurrent_streams_on_a_real_worker(redis_url: str, workers) -> None:
    workers.start("w1", backend__slots=8)

    async def main() -> tuple[list[str], list[str]]:
        async with AsyncFleet(redis_url) as fleet:
            jobs = [await fleet.submit(prompt=f"Story {i}: the", max_tokens=12, temperature=0.0)
                    for i in range(8)]

            async def text(job: Any) -> str:
                return "".join([d async for d in job.stream(timeout=120)])

            texts = await asyncio.gather(*(text(j) for j in jobs))
            return list(texts), [(await j.result(timeout=5))["text"] for j in jobs]

    texts, finals = run(main())
    assert texts == finals and all(texts)


def test_hundreds_of_open_streams_cost_a_few_connections(redis: Redis, redis_url: str) -> None:
    ids = [f"many-{i}" for i in range(300)]

    async def main() -> tuple[list[str], int]:
        async with AsyncFleet(redis_url, max_connections=4) as fleet:
            baseline = len(redis.client_list())
            tasks = [asyncio.create_task(fleet.job(i).result(timeout=30)) for i in ids]
            while fleet.streams.following < len(ids):
                await asyncio.sleep(0.01)
            opened = len(redis.client_list()) - baseline
            for i in ids:  # every job writes its text and ends while all 300 are followed
                write(redis, i, (1, 0, i))
                done(redis, i, 1, i)
            results = await asyncio.gather(*tasks)
            return [r["text"] for r in results], opened

    texts, opened = run(main())
    assert texts == ids
    assert opened <= 4


def test_attempt_rules_match_the_sync_reader(redis: Redis, redis_url: str) -> None:
    write(redis, "a1", (1, 0, "Hello"), (1, 1, " wor"), (2, 0, "Hello"), (2, 1, " world"), (2, 2, "!"))
    done(redis, "a1", 2, "Hello world!")
    write(redis, "a2", (1, 0, "Once"), (1, 1, " upon"), (2, 0, "In a"), (2, 1, " galaxy"))
    done(redis, "a2", 2, "In a galaxy")

    async def main() -> tuple[list[str], str, str]:
        async with AsyncFleet(redis_url) as fleet:
            seamless = [d async for d in fleet.job("a1").stream(timeout=5)]
            shown = []
            with pytest.raises(JobRestarted) as restarted:
                async for d in fleet.job("a2").stream(timeout=5):
                    shown.append(d)
            assert "".join(shown) == restarted.value.delivered == "Once upon"
            redis.hset(job_key("a2"), ATTEMPT_FIELD, 1)  # what the requeue recorded
            again = "".join([d async for d in fleet.job("a2").stream(timeout=5)])
            return seamless, again, (await fleet.job("a2").result(timeout=5))["text"]

    seamless, again, final = run(main())
    assert seamless == list(Fleet(redis_url).job("a1").stream(timeout=5)) == ["Hello", " wor", "ld", "!"]
    assert again == final == "In a galaxy"


def test_a_follower_joining_a_blocked_reader_gets_its_entries_at_once(redis: Redis, redis_url: str) -> None:
    async def main() -> float:
        async with AsyncFleet(redis_url) as fleet:
            fleet.streams.block_ms = 5000
            idle = asyncio.create_task(fleet.job("quiet").result(timeout=10))  # keeps XREAD blocked
            await asyncio.sleep(0.3)
            write(redis, "late", (1, 0, "hi"))
            done(redis, "late", 1, "hi")
            started = time.monotonic()
            assert (await fleet.job("late").result(timeout=10))["text"] == "hi"
            idle.cancel()
            return time.monotonic() - started

    assert run(main()) < 2.0  # not the 5 s block: the wake stream ended the blocked XREAD


def test_cancel_a_queued_job_and_validation(redis_url: str) -> None:
    async def main() -> tuple[str, dict[str, Any], int]:
        async with AsyncFleet(redis_url) as fleet:
            with pytest.raises(ValueError, match="temperature"):
                await fleet.submit(prompt="x", temperature=99.0)
            with pytest.raises(ValueError, match="JSON schema"):
                await fleet.submit(prompt="x", format={"type": "no-such-type"})
            job = await fleet.submit(prompt="no worker runs this", max_tokens=4)
            state = await job.cancel()
            depth = int(Redis.from_url(redis_url).llen(queue_key("llm:default")))
            return state, await job.result(timeout=5), depth

    state, res, depth = run(main())
    assert state == "cancelled" and res["finish_reason"] == "cancelled" and depth == 0


@pytest.mark.model
def test_a_failed_job_raises_job_failed(redis_url: str, workers) -> None:
    workers.start("w1", backend__slots=2)

    async def main() -> None:
        async with AsyncFleet(redis_url) as fleet:
            job = await fleet.submit(prompt="word " * 5000, max_tokens=4)  # longer than a slot's context
            with pytest.raises(JobFailed):
                async for _ in job.stream(timeout=60):
                    pass

    run(main())
