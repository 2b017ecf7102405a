"""Placement by held prefixes: the keys a producer and a worker compute (contract/affinity.py),
and the claim (placement.lua) on a real redis-server, then two real workers: a chat's next
turn is claimed by the worker that ran the last one; a holder that is full or gone is not
waited for; a worker that balance holds back still takes the jobs it holds."""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest
from redis import Redis

from backends.contract.affinity import FIELD, HELD_TTL, held_key, held_keys, job_keys
from backends.contract.keys import (
    CAPACITY_LIVE_MS,
    WORKER_WAKE_TTL,
    capacity_key,
    has_room,
    job_key,
    queue_key,
    wake_key,
    worker_wake_key,
)
from backends.contract.schema import GenerateRequest
from dispatcher import Fleet
from tests.harness import wait_for
from tests.reliability_checks import Workers, live_free_slots
from worker.claiming.claim import Claimer

POOL = "llm"
QUEUE = f"{POOL}:default"
HISTORY = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a river."}]


def chat(*messages: dict[str, str], **fields: object) -> GenerateRequest:
    return GenerateRequest.model_validate({"messages": list(messages), **fields})


def test_the_next_turn_carries_the_keys_its_last_turn_left() -> None:
    turn1 = chat(*HISTORY)
    again = {"role": "user", "content": "Another?"}
    exact = chat(*HISTORY, {"role": "assistant", "content": "The Nile."}, again)
    edited = chat(*HISTORY, {"role": "assistant", "content": "Nile"}, again)
    prompt_key, answered_key = held_keys(turn1, "The Nile.")
    # longest first: the whole new prompt (nobody holds it yet), then the last turn's answer and prompt
    assert job_keys(exact)[1:3] == [answered_key, prompt_key]
    assert answered_key not in job_keys(edited) and prompt_key in job_keys(edited)
    other_tenant = chat(*HISTORY, {"role": "assistant", "content": "The Nile."}, tenant="b")
    assert not set(job_keys(other_tenant)) & {prompt_key, answered_key}  # tenants never share
    hinted = chat({"role": "user", "content": "hi"}, cache_key="conv-7")
    assert job_keys(hinted)[0] == held_keys(hinted, "x")[0]  # the hint first, both ways
    text = "lorem ipsum " * 100  # 1,200 characters: two whole 512-character blocks
    held = held_keys(GenerateRequest(prompt=text), " and more " * 60)
    assert held[0] in job_keys(GenerateRequest(prompt=text + " and more " * 60 + "Next?"))


def enqueue(redis: Redis, job_id: str, keys: list[str]) -> None:
    redis.hset(job_key(job_id), mapping={"status": "queued", FIELD: " ".join(keys)})
    redis.rpush(queue_key(QUEUE), job_id)


def hold(redis: Redis, worker: str, key: str) -> None:
    redis.set(held_key(POOL, key), worker, ex=HELD_TTL)


def ids(pairs: list[tuple[bytes, str]]) -> list[str]:
    return [raw.decode() for raw, _queue in pairs]


def test_a_job_another_live_worker_holds_is_left_to_it(redis: Redis) -> None:
    a, b = Claimer(redis, "a", [QUEUE], slots=4), Claimer(redis, "b", [QUEUE], slots=4)
    a.claim(4), b.claim(4)  # both live, 4 free slots each
    hold(redis, "b", "beef")
    enqueue(redis, "for-b", ["cafe", "beef"])
    enqueue(redis, "anyone", ["f00d"])
    # (a claim asks for as many jobs as the worker has free slots)
    assert ids(a.claim(4)) == ["anyone"]  # the head is b's: a takes the next one
    assert ids(a.claim(3)) == []  # only b's is left
    assert ids(b.claim(4)) == ["for-b"]


def test_a_job_left_to_its_holder_wakes_the_holder(redis: Redis) -> None:
    a, b = Claimer(redis, "a", [QUEUE], slots=4), Claimer(redis, "b", [QUEUE], slots=4)
    a.claim(4), b.claim(4)
    hold(redis, "b", "beef")
    enqueue(redis, "for-b", ["beef"])
    assert ids(a.claim(4)) == [] and ids(a.claim(4)) == []  # left to b, twice
    own = worker_wake_key(POOL, "b")
    # b, idle, blocks on this list (worker/serving/loop.py) and claims at once: one token, with a TTL
    assert redis.lrange(own, 0, -1) == [b"1"] and 0 < redis.ttl(own) <= WORKER_WAKE_TTL
    assert not redis.exists(worker_wake_key(POOL, "a"))
    assert redis.blpop([wake_key(POOL), own], timeout=1) == (own.encode(), b"1")
    assert ids(b.claim(4)) == ["for-b"]


def test_a_full_or_gone_holder_is_not_waited_for(redis: Redis) -> None:
    a = Claimer(redis, "a", [QUEUE], slots=2)
    a.claim(2)
    hold(redis, "b", "beef")
    enqueue(redis, "x", ["beef"])
    assert ids(a.claim(1)) == ["x"]  # b never said it has room
    redis.hset(capacity_key(POOL), "b", f"0|2|{int(time.time() * 1000)}")  # b is full
    enqueue(redis, "y", ["beef"])
    assert ids(a.claim(1)) == ["y"]
    sec, usec = redis.time()
    stale = sec * 1000 + usec // 1000 - CAPACITY_LIVE_MS - 500
    redis.hset(capacity_key(POOL), "b", f"2|2|{stale}")  # b's last word is too old: gone
    enqueue(redis, "z", ["beef"])
    assert ids(a.claim(1)) == ["z"]


def server_ms(redis: Redis) -> int:
    sec, usec = redis.time()
    return sec * 1000 + usec // 1000


def test_a_busy_or_gone_holders_job_goes_to_a_worker_of_its_store(redis: Redis) -> None:
    """The holder left the prefix in its KV store too: when it has no room, the job waits for a
    live worker with room that opens that store (it restores instead of prefilling), not for
    whoever claims first; with none of them free, anyone takes it."""
    holder = Claimer(redis, "holder", [QUEUE], slots=2, store="5a5a")
    peer = Claimer(redis, "peer", [QUEUE], slots=2, store="5a5a")
    elsewhere = Claimer(redis, "elsewhere", [QUEUE], slots=2, store="0b0b")
    holder.claim(2), peer.claim(2), elsewhere.claim(2)
    assert redis.hget(capacity_key(POOL), "peer").decode().endswith("|5a5a")
    hold(redis, "holder", "beef")
    redis.hset(capacity_key(POOL), "holder", f"0|2|{server_ms(redis)}|5a5a")  # busy: full
    enqueue(redis, "turn-2", ["beef"])
    assert ids(elsewhere.claim(2)) == []  # left to peer, which reads the holder's store
    assert redis.lrange(worker_wake_key(POOL, "peer"), 0, -1) == [b"1"]
    assert ids(peer.claim(2)) == ["turn-2"]
    redis.hset(capacity_key(POOL), "holder", f"2|2|{server_ms(redis) - CAPACITY_LIVE_MS - 500}|5a5a")  # gone
    enqueue(redis, "turn-3", ["beef"])
    assert ids(elsewhere.claim(2)) == []
    assert ids(peer.claim(1)) == ["turn-3"]
    redis.hset(capacity_key(POOL), "peer", f"0|2|{server_ms(redis)}|5a5a")  # the store's workers are all full
    enqueue(redis, "turn-4", ["beef"])
    assert ids(elsewhere.claim(1)) == ["turn-4"]  # balance wins over the cache


def test_a_worker_past_its_share_still_takes_a_job_left_to_it_by_store(redis: Redis) -> None:
    peer = Claimer(redis, "peer", [QUEUE], slots=4, store="5a5a")
    peer.claim(4), Claimer(redis, "other", [QUEUE], slots=4).claim(4)
    for i in range(2):
        enqueue(redis, f"plain-{i}", [])
    assert len(peer.claim(4)) == 1  # its share of 2 queued on two idle workers
    hold(redis, "gone", "beef")
    redis.hset(capacity_key(POOL), "gone", f"1|4|{server_ms(redis) - CAPACITY_LIVE_MS - 500}|5a5a")
    enqueue(redis, "restore-me", ["beef"])
    # its share of 3 jobs is 2: plain-1, then, past it, only what is left to it: the gone holder's job
    assert ids(peer.claim(3)) == ["plain-1", "restore-me"]


def test_capacity_entries_with_a_store_parse_for_balance_and_room(redis: Redis) -> None:
    now = server_ms(redis)
    assert has_room(f"1|2|{now}|5a5a", now) and has_room(f"1|2|{now}", now)
    assert not has_room(f"0|2|{now}|5a5a", now) and not has_room(f"1|2|{now}|5a|5a", now)
    a = Claimer(redis, "a", [QUEUE], slots=2, store="not hex!")  # never written into the entry
    a.claim(2)
    assert redis.hget(capacity_key(POOL), "a").decode().count("|") == 2


def test_balance_still_lets_a_worker_take_what_it_holds(redis: Redis) -> None:
    a, b = Claimer(redis, "a", [QUEUE], slots=4), Claimer(redis, "b", [QUEUE], slots=4)
    a.claim(4), b.claim(4)
    for i in range(4):
        enqueue(redis, f"plain-{i}", [])
    assert len(a.claim(4)) == 2  # its share of 4 queued on two idle workers
    hold(redis, "a", "beef")
    enqueue(redis, "mine", ["beef"])
    # a runs 2 of the 5 jobs there are: its share is 3, so one more: its own job, not the head
    got = ids(a.claim(2))
    assert "mine" in got and len(got) <= 2


def test_placement_off_claims_in_queue_order(redis: Redis) -> None:
    a = Claimer(redis, "a", [QUEUE], slots=4, placement=False)
    b = Claimer(redis, "b", [QUEUE], slots=4)
    a.claim(4), b.claim(4)
    hold(redis, "b", "beef")
    enqueue(redis, "for-b", ["beef"])
    assert ids(a.claim(4)) == ["for-b"]


def test_a_crafted_affinity_field_is_only_looked_up(redis: Redis) -> None:
    a, b = Claimer(redis, "a", [QUEUE], slots=4), Claimer(redis, "b", [QUEUE], slots=4)
    a.claim(4), b.claim(4)
    redis.hset(job_key("odd"), mapping={"status": "queued", FIELD: "fleet:inflight:b ../../x " + "ab " * 50})
    redis.rpush(queue_key(QUEUE), "odd")
    redis.set(f"fleet:held:{POOL}:x", "b")  # 'x' is no hex word: never looked up
    redis.rpush(queue_key(QUEUE), "no-hash")  # no job hash at all: still claimed, in order
    assert ids(a.claim(4)) == ["odd"]  # its share of two queued jobs on two idle workers
    assert ids(b.claim(4)) == ["no-hash"]


@pytest.mark.model
def test_each_conversation_returns_to_its_worker(redis_url: str, workers: Workers) -> None:
    """Two real workers; four conversations of three turns: every later turn runs where the turn
    before it ran (where its KV is), and the worker says it holds the prefix for HELD_TTL."""
    # each on its own core, as `fleet up` places them: two unpinned llama.cpp thread pools on the
    # same cores spin against each other, and a step then outlasts CAPACITY_LIVE_MS
    cores = sorted(os.sched_getaffinity(0))
    for i, name in enumerate(("p0", "p1")):
        workers.start(name, backend__slots=4, cpus=str(cores[i % len(cores)]))
    fleet, redis = Fleet(redis_url), Redis.from_url(redis_url)
    chats = [[{"role": "user", "content": f"Conversation {c}: name a colour."}] for c in range(4)]
    where: list[list[str]] = [[] for _ in chats]
    for turn in range(3):
        # each turn starts with both workers idle and saying so lately enough to count: then a
        # holder is waited for unless a step of its own outlasts CAPACITY_LIVE_MS mid-turn
        wait_for(lambda: live_free_slots(redis, POOL) == {"p0": 4, "p1": 4}, 30,
                 "both workers idle, their capacity entries fresh")
        jobs = [fleet.submit(messages=history, max_tokens=6, temperature=0.0) for history in chats]
        for c, job in enumerate(jobs):
            result = job.result(timeout=120)
            where[c].append(result["worker"])
            chats[c] += [{"role": "assistant", "content": result["text"]},
                         {"role": "user", "content": f"And another, turn {turn + 2}?"}]
    # every later turn stays (claiming blind to prefixes moves about half)
    stayed = sum(w[t] == w[t - 1] for w in where for t in (1, 2))
    assert stayed == 8, where
    assert len(Counter(w[0] for w in where)) == 2, where  # and the conversations spread
    held = list(redis.scan_iter(f"fleet:held:{POOL}:*"))
    assert held and all(0 < redis.ttl(k) <= HELD_TTL for k in held)
