"""Balance at the claim (the queue model's balance.lua), on a real redis-server: a burst spreads over the
live workers by their free slots instead of landing on the first to wake; a worker alone, or
beside workers that are full or gone, still takes everything it has room for."""

from __future__ import annotations

import os
from collections import Counter

import pytest
from redis import Redis

from backends.contract.keys import CAPACITY_LIVE_MS, capacity_key, queue_key
from dispatcher import Fleet
from tests.harness import wait_for
from tests.reliability_checks import Workers, live_free_slots
from worker.claiming.claim import Claimer

POOL = "llm"
QUEUE = f"{POOL}:default"


def claimers(redis: Redis, n: int, slots: int = 16) -> list[Claimer]:
    return [Claimer(redis, f"w{i}", [QUEUE], slots=slots) for i in range(n)]


def push(redis: Redis, n: int) -> None:
    redis.rpush(queue_key(QUEUE), *[f"job-{i}" for i in range(n)])


def server_ms(redis: Redis) -> int:
    sec, usec = redis.time()
    return sec * 1000 + usec // 1000


def test_a_burst_splits_evenly_between_idle_workers(redis: Redis) -> None:
    a, b = claimers(redis, 2)
    a.claim(16), b.claim(16)  # both idle: each says it has 16 free slots
    push(redis, 8)
    got_a = a.claim(16)
    assert len(got_a) == 4
    assert a.claim(12) == []  # its share is taken while b, live with free slots, has none
    assert len(b.claim(16)) == 4
    assert redis.llen(queue_key(QUEUE)) == 0


def test_32_jobs_over_four_workers(redis: Redis) -> None:
    four = claimers(redis, 4, slots=8)
    for c in four:
        c.claim(8)
    push(redis, 32)
    taken = [len(c.claim(8)) for c in four]
    assert taken == [8, 8, 8, 8]


def test_unequal_slots_share_by_slots(redis: Redis) -> None:
    big, small = Claimer(redis, "big", [QUEUE], slots=12), Claimer(redis, "small", [QUEUE], slots=4)
    big.claim(12), small.claim(4)
    push(redis, 8)
    assert len(big.claim(12)) == 6
    assert len(small.claim(4)) == 2


def test_alone_a_worker_takes_all_and_a_loaded_one_leaves_the_rest(redis: Redis) -> None:
    a, b = claimers(redis, 2)
    a.claim(16)
    push(redis, 8)
    assert len(a.claim(16)) == 8  # alone: nobody else has a live entry
    b.claim(16)
    push(redis, 8)
    # a runs 8 and has 8 free, b runs none: the work (8 queued + 8 running) halves to 8 each
    assert len(a.claim(8)) == 0
    assert len(b.claim(16)) == 8


def test_a_full_worker_does_not_hold_back_the_others(redis: Redis) -> None:
    a, b = claimers(redis, 2)
    b.claim(16)
    push(redis, 16)
    assert len(b.claim(16)) == 16  # a never claimed: b is alone
    push(redis, 8)
    a.claim(0)  # nothing asked: no entry
    assert len(a.claim(16)) == 8  # b is full (0 free): nobody else has room


def test_a_stale_entry_counts_for_nothing(redis: Redis) -> None:
    a = Claimer(redis, "a", [QUEUE], slots=16)
    old = server_ms(redis) - CAPACITY_LIVE_MS - 1000
    redis.hset(capacity_key(POOL), "gone", f"16|16|{old}")
    push(redis, 8)
    assert len(a.claim(16)) == 8
    assert redis.ttl(capacity_key(POOL)) > 0


@pytest.mark.model
def test_a_burst_on_two_real_workers_is_shared(redis_url: str, workers: Workers) -> None:
    """Two idle worker processes on the real model, one core each; a burst of 8 jobs submitted at
    once: each runs half (without balance the first to wake took 7)."""
    for i in range(2):
        workers.start(f"spread-{i}", cpus=str(i % len(os.sched_getaffinity(0))), backend__slots=8)
    fleet, redis = Fleet(redis_url), Redis.from_url(redis_url)
    # both idle and polling: each has said, lately enough to count, that all its slots are free
    wait_for(lambda: live_free_slots(redis, POOL) == {"spread-0": 8, "spread-1": 8}, 30,
             "both workers' fresh capacity entries")
    jobs = [fleet.submit(prompt=f"Count to {i}:", max_tokens=8, temperature=0.0) for i in range(8)]
    split = Counter(job.result(timeout=120)["worker"] for job in jobs)
    assert sorted(split.values()) == [4, 4], split
