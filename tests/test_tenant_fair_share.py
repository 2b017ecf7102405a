"""Fair share between tenants at the claim (the queue model's claim.lua), on a real redis-server: tenants with
work at one priority take turns in proportion to their weights, whatever each has queued; idle
time earns no credit; jobs naming no tenant are the default tenant's; crafted state loses no id;
RQ's own tools still see ordinary queues."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
from redis import Redis
from rq import Queue

from backends.base import Done
from backends.contract.gateway_settings import FairTokens
from backends.contract.keys import fair_key, fair_spent_key, inflight_key, job_key, queue_key
from backends.contract.queue import fair
from dispatcher import Fleet
from tests.harness import wait_for
from tests.reliability_checks import fleet_workers, streaming
from worker.assembly import job_hooks
from worker.claiming.claim import Claimer
from worker.liveness.reaper import Reaper
from worker.serving import endings, rqjobs

POOL = "llm"
QUEUE = f"{POOL}:default"


def tenant_of(redis: Redis, raw_id: bytes) -> str:
    origin = (redis.hget(job_key(raw_id.decode()), "origin") or b"").decode()
    return origin[len(QUEUE) + 1:] or "default"


def claim_order(redis: Redis, claimer: Claimer, n: int, batch: int = 4) -> list[str]:
    """Tenants of the next `n` claims, taken `batch` at a time as a worker with free slots would."""
    order: list[str] = []
    while len(order) < n:
        got = claimer.claim(min(batch, n - len(order)))
        if not got:
            break
        order += [tenant_of(redis, raw) for raw, _queue in got]
    return order


def submit(fleet: Fleet, tenant: str | None, n: int) -> list[str]:
    extra = {"tenant": tenant} if tenant else {}
    return [fleet.submit(prompt=f"{tenant} {i}", max_tokens=2, **extra).id for i in range(n)]


def test_two_tenants_alternate_whatever_one_has_queued(redis_url: str, redis: Redis) -> None:
    fleet = Fleet(redis_url)
    submit(fleet, "bulk", 300)
    submit(fleet, "chat", 8)
    order = claim_order(redis, Claimer(redis, "w", [QUEUE]), 16)
    # chat's 8 jobs are claimed within the first 16, not after bulk's 300
    assert Counter(order) == {"bulk": 8, "chat": 8}, order
    assert all(order[i] != order[i + 1] for i in range(15)), order  # strict turns at equal weights


def test_weights_share_the_claims_in_proportion(redis_url: str, redis: Redis) -> None:
    fleet = Fleet(redis_url)
    submit(fleet, "a", 100)
    submit(fleet, "b", 100)
    order = claim_order(redis, Claimer(redis, "w", [QUEUE], weights={"b": 3}), 40)
    assert Counter(order) == {"a": 10, "b": 30}, order


def test_jobs_without_a_tenant_are_the_default_tenants_share(redis_url: str, redis: Redis) -> None:
    fleet = Fleet(redis_url)
    rq = Queue(QUEUE, connection=redis, serializer="json")  # a plain RQ producer, no tenant
    plain = [rq.enqueue("dispatcher.jobs.generate", {"prompt": f"p{i}", "max_tokens": 2}).id
             for i in range(20)]
    submit(fleet, "team", 20)
    # a job with no size (the plain producer's) is charged `unsized` tokens: here the team's jobs'
    # own size ("team 0": 2 prompt tokens, max_tokens 2 at weight 2), so both take equal turns
    claimer = Claimer(redis, "w", [QUEUE], tokens=FairTokens(unsized=6))
    order = claim_order(redis, claimer, 20)
    assert Counter(order) == {"default": 10, "team": 10}, order
    # RQ's view: the tenant's queue is an RQ queue with its jobs, the pool's queue holds the rest
    assert Queue(f"{QUEUE}:team", connection=redis).count == 10
    assert Queue(QUEUE, connection=redis).count == 10
    assert set(plain[10:]) == set(Queue(QUEUE, connection=redis).job_ids)


def test_idle_time_earns_no_credit(redis_url: str, redis: Redis) -> None:
    """A tenant that was away does not get a run of claims to "catch up" on the other's history."""
    fleet = Fleet(redis_url)
    claimer = Claimer(redis, "w", [QUEUE])
    submit(fleet, "early", 200)
    assert claim_order(redis, claimer, 60) == ["early"] * 60
    submit(fleet, "late", 50)
    order = claim_order(redis, claimer, 20)
    assert Counter(order) == {"early": 10, "late": 10}, order


def test_a_crafted_tenant_entry_loses_no_job(redis_url: str, redis: Redis) -> None:
    """A fair-share member whose queue key is not a list (or names anything) is dropped; the
    claim goes on and every real job is claimed exactly once."""
    fleet = Fleet(redis_url)
    ids = submit(fleet, "real", 5) + submit(fleet, None, 5)
    redis.zadd(fair_key(QUEUE), {"evil": -1, "../../x": -2, "": -3})
    redis.set(queue_key(f"{QUEUE}:evil"), "not a list")
    claimer = Claimer(redis, "w", [QUEUE])
    got = [raw.decode() for raw, queue in claimer.claim(16)]
    assert sorted(got) == sorted(ids)
    assert redis.lrange(inflight_key("w"), 0, -1) == [i.encode() for i in got]
    assert redis.get(queue_key(f"{QUEUE}:evil")) == b"not a list"  # left as it was


def test_fair_share_state_has_a_ttl(redis_url: str, redis: Redis) -> None:
    fleet = Fleet(redis_url)
    submit(fleet, "a", 3)
    submit(fleet, "b", 3)
    claimer = Claimer(redis, "w", [QUEUE])
    claimer.claim(2)
    for key in (fair_key(QUEUE), fair_key(QUEUE) + ":clock"):
        assert 0 < redis.ttl(key) <= 86400, key
    claimer.claim(8)  # both run out of work: their counters are kept, for a day at most
    assert redis.hlen(fair_spent_key(QUEUE)) == 2
    assert 0 < redis.ttl(fair_spent_key(QUEUE)) <= 86400


def test_tenant_jobs_run_cancel_and_end_on_a_worker(redis_url: str, redis: Redis, tmp_path: Path) -> None:
    fleet = Fleet(redis_url)
    queued = fleet.submit(prompt="never runs", max_tokens=2, tenant="team")
    assert queued.cancel() == "cancelled"  # off its tenant queue at once
    assert redis.llen(queue_key(f"{QUEUE}:team")) == 0
    jobs = [fleet.submit(prompt=f"hello {i}", max_tokens=3, tenant=t) for i, t in enumerate(["a", "b", "a"])]
    with fleet_workers(redis_url, tmp_path / "logs") as workers:
        workers.start("w1", backend__type="fake")
        results = [job.result(timeout=30) for job in jobs]
    assert [r["text"] for r in results] == ["hello 0", "hello 1", "hello 2"]
    assert queued.result(timeout=5)["finish_reason"] == "cancelled"


def test_slots_are_shared_so_a_newcomer_starts_at_once(redis_url: str, redis: Redis) -> None:
    """A lone tenant leaves one slot free; once another has work, each may hold its weight's
    share of the slots, so the newcomer's jobs take the slots the first one's jobs free."""
    fleet = Fleet(redis_url)
    claimer = Claimer(redis, "w", [QUEUE], weights={"b": 3}, slots=16)
    submit(fleet, "a", 100)
    first = claimer.claim(16, held={})
    assert len(first) == 15  # one slot kept for whoever comes next
    submit(fleet, "b", 20)
    assert [tenant_of(redis, raw) for raw, _ in claimer.claim(1, held={"a": 15})] == ["b"]
    # a holds 15 of 16 with weight 1 of 4: while a is not behind in tokens, free slots go to b
    for a_held in (14, 10):
        got = [tenant_of(redis, raw) for raw, _ in claimer.claim(1, held={"a": a_held, "b": 16 - a_held})]
        assert got == ["b"], (a_held, got)
    # b was charged 3 jobs since it came (at weight 3: one of a's), a none: a is a whole job behind
    # and may take a slot beyond its share, before b has its 12
    got = [tenant_of(redis, raw) for raw, _ in claimer.claim(1, held={"a": 5, "b": 11})]
    assert got == ["a"], got
    got = [tenant_of(redis, raw) for raw, _ in claimer.claim(4, held={"a": 3, "b": 9})]
    assert Counter(got) == {"a": 1, "b": 3}, got


def test_a_tenant_between_two_requests_keeps_its_share_for_a_moment(
        redis_url: str, redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Closed-loop users resubmit moments after an answer: the slots they just freed are not
    another tenant's backlog's meanwhile (or they would wait for it to give way), for
    RECENT_SECONDS; after that a lone tenant takes all but one slot again."""
    import worker.claiming.claim as claim

    fleet = Fleet(redis_url)
    claimer = Claimer(redis, "w", [QUEUE], slots=16)
    submit(fleet, "a", 100)
    assert len(claimer.claim(8, held={"a": 4, "b": 8})) == 4  # a and b: 8 slots each
    # b's 8 jobs ended a moment ago, none queued: a still stops at its 8
    assert claimer.claim(8, held={"a": 8}) == []
    monkeypatch.setattr(claim, "RECENT_SECONDS", 0.2)
    time.sleep(0.25)
    assert len(claimer.claim(8, held={"a": 8})) == 7  # b is gone: all but one slot


def test_a_full_worker_learns_who_should_give_way(redis_url: str, redis: Redis) -> None:
    fleet = Fleet(redis_url)
    claimer = Claimer(redis, "w", [QUEUE], slots=16)
    submit(fleet, "a", 40)
    assert claimer.starved({"a": 15}) == ({}, {})  # alone: nobody waits
    submit(fleet, "b", 5)
    want, over = claimer.starved({"a": 16})
    assert want == {"b": 5} and over == {"a": 8}  # b may take 5 of its 8; a holds 8 above its 8
    assert claimer.starved({"a": 8, "b": 8}) == ({}, {})


def test_a_full_worker_gives_way_to_a_tenant_below_its_share(redis_url: str, redis: Redis,
                                                             tmp_path: Path) -> None:
    """Tenant a fills a worker; tenant b's two jobs start within a few steps, not after a's end:
    a's newest job is handed back (not counted as a failed attempt) and ends later all the same."""
    fleet = Fleet(redis_url)
    long = " ".join(f"w{i}" for i in range(60))  # the fake engine says one word a step
    with fleet_workers(redis_url, tmp_path / "logs") as workers:
        workers.start("w1", backend__type="fake", backend__slots=4, backend__step_delay=0.1)
        a_jobs = [fleet.submit(prompt=long, max_tokens=60, tenant="a") for _ in range(4)]
        wait_for(lambda: len(streaming(redis, "w1")) >= 3, 30, "a's jobs running")
        started = time.monotonic()
        b_jobs = [fleet.submit(prompt="short one", max_tokens=2, tenant="b") for _ in range(2)]
        b_done = [job.result(timeout=30) for job in b_jobs]
        waited = time.monotonic() - started
        a_done = [job.result(timeout=60) for job in a_jobs]
    assert [r["text"] for r in b_done] == ["short one"] * 2
    assert waited < 3.0, f"b waited {waited:.1f}s: a's jobs take 6s"  # a step is 0.1 s
    assert all(r["text"] == long for r in a_done)
    handed_back = [r for r in a_done if r["attempt"] > 1]
    assert handed_back, "no job of a gave way"
    for r in handed_back:  # a preemption is no failure: it used none of the job's attempts
        assert redis.hget(job_key(r["job_id"]), "fleet_drains") == str(r["attempt"] - 1).encode()


# -- fair share in tokens (the Virtual Token Counter: backends/contract/queue/fair.py) ----------------

BIG, SMALL = 3000, 100  # prompt tokens of tenant a's documents and tenant b's questions (chars / 4)


def backlog(fleet: Fleet, tenant: str, prompt_tokens: int, n: int, max_tokens: int = 64) -> dict[str, float]:
    """`n` jobs of `prompt_tokens` (as the producer estimates them) for `tenant`: id -> the
    service each is charged at its claim, in weighted tokens (prompt 1, generated 2)."""
    text = ("word " * prompt_tokens)[:prompt_tokens * 4]
    return {fleet.submit(prompt=text, max_tokens=max_tokens, tenant=tenant).id:
            prompt_tokens + 2.0 * max_tokens for _ in range(n)}


def served_by_claims(redis: Redis, claimer: Claimer, sizes: dict[str, float], n: int) -> dict[str, float]:
    """The service each tenant's claimed jobs add up to, over the next `n` claims (4 at a time)."""
    served: dict[str, float] = {}
    for _ in range(n // 4):
        for raw, _queue in claimer.claim(4):
            tenant = tenant_of(redis, raw)
            served[tenant] = served.get(tenant, 0.0) + sizes[raw.decode()]
    return served


def test_equal_weights_share_the_tokens_not_the_claims(redis_url: str, redis: Redis) -> None:
    """Tenant a's jobs carry 3,000-token documents, b's 100-token questions: counted in claims
    a got ~14x b's tokens; counted in tokens each gets half."""
    fleet = Fleet(redis_url)
    sizes = backlog(fleet, "a", BIG, 40) | backlog(fleet, "b", SMALL, 400)
    served = served_by_claims(redis, Claimer(redis, "w", [QUEUE]), sizes, 300)
    assert 0.85 <= served["a"] / served["b"] <= 1.15, served
    assert redis.llen(queue_key(f"{QUEUE}:a")) and redis.llen(queue_key(f"{QUEUE}:b"))  # both still waiting


def test_weights_share_the_tokens_in_proportion(redis_url: str, redis: Redis) -> None:
    fleet = Fleet(redis_url)
    sizes = backlog(fleet, "a", BIG, 60) | backlog(fleet, "b", SMALL, 400)
    served = served_by_claims(redis, Claimer(redis, "w", [QUEUE], weights={"a": 3}), sizes, 200)
    assert 3 * 0.85 <= served["a"] / served["b"] <= 3 * 1.15, served
    assert redis.llen(queue_key(f"{QUEUE}:a")) and redis.llen(queue_key(f"{QUEUE}:b"))


def end_job(redis: Redis, worker: str, raw: bytes, queue: str, *, prompt: int, cached: int,
            generated: int) -> None:
    """Start and end a claimed job as `worker` does, with that usage."""
    job_id = raw.decode()
    writer = endings.AttemptWriter(redis, worker, "fake", 600, job_hooks())
    job = rqjobs.load(redis, job_id, queue, 600, me=worker)
    assert writer.start(job, 600)
    job.ending = endings.finished(job, Done(job_id, "stop", prompt, generated, cached), time.monotonic(),
                                  worker, "fake")
    assert writer.end([job]) == {job_id}


def test_a_job_is_charged_once_and_corrected_to_what_it_was_served(redis_url: str, redis: Redis) -> None:
    """Charged its estimate at the claim, not again when a dead worker's job is claimed again,
    and corrected at its ending to its usage: prompt 1, cached 0.1, generated 2 a token."""
    fleet = Fleet(redis_url)
    backlog(fleet, "t", SMALL, 1)  # charged 100 + 2 x 64
    [(raw, queue)] = Claimer(redis, "w1", [QUEUE]).claim(1)
    assert redis.zscore(fair_key(QUEUE), "t") == 228
    Reaper(redis, "w2", max_attempts=3, result_ttl=600).reap_worker("w1")  # w1 died: handed back
    assert redis.lrange(queue_key(f"{QUEUE}:t"), 0, -1) == [raw]
    [(again, queue)] = Claimer(redis, "w2", [QUEUE]).claim(1)
    assert again == raw and redis.zscore(fair_key(QUEUE), "t") == 228
    end_job(redis, "w2", raw, queue, prompt=90, cached=40, generated=10)
    assert redis.zscore(fair_key(QUEUE), "t") == pytest.approx(50 + 4 + 20)
    # the correction is idempotent: once more, nothing moves
    keys, args = fair.correct_call(raw.decode(), QUEUE, "t", 74.0)
    redis.eval(fair.FAIR_CORRECT, len(keys), *keys, *args)
    assert redis.zscore(fair_key(QUEUE), "t") == pytest.approx(74)


def test_a_job_of_unknown_length_pays_at_its_end_even_after_its_tenant_left(redis_url: str,
                                                                           redis: Redis) -> None:
    """A job without max_tokens is charged its prompt at the claim and what it generated at its
    end. Its tenant ran out of work meanwhile: the counter it left with is kept and corrected, so
    when it comes back the other tenant is served until it has caught up."""
    fleet = Fleet(redis_url)
    backlog(fleet, "b", SMALL, 200)
    long_id = fleet.submit(prompt="word " * 10, max_tokens=None, tenant="a").id  # 13 tokens, no max
    claimer = Claimer(redis, "w", [QUEUE])
    claimed = {raw: queue for raw, queue in claimer.claim(4)}
    assert long_id.encode() in claimed
    claimer.claim(4)  # a has no more work: it leaves the fair share, its counter kept
    assert redis.zscore(fair_key(QUEUE), "a") is None
    end_job(redis, "w", long_id.encode(), claimed[long_id.encode()], prompt=13, cached=0, generated=2000)
    backlog(fleet, "a", SMALL, 5)
    order = [tenant_of(redis, raw) for _ in range(5) for raw, _q in claimer.claim(4)]
    # b was charged 7 jobs (7 x 228), a comes back at 13 + 2 x 2,000: b's next 11 jobs go first
    assert order.index("a") == 11, order


def test_a_tenant_behind_in_tokens_takes_slots_beyond_its_share(redis_url: str, redis: Redis) -> None:
    """Slots shared by weight alone, a tenant of 3,000-token documents and one of 100-token
    questions hold 2 of 4 slots each, and the first gets ~14x the tokens whatever the claim
    order. A tenant behind in tokens (still the lowest after its next job's charge) may take any
    free slot, and nobody makes it give them back while it is behind."""
    fleet = Fleet(redis_url)
    backlog(fleet, "a", BIG, 10)
    backlog(fleet, "b", SMALL, 100)
    claimer = Claimer(redis, "w", [QUEUE], slots=4)
    assert [tenant_of(redis, raw) for raw, _ in claimer.claim(4, held={})] == ["a", "b", "b", "b"]
    # one of b's jobs ended: b holds its 2 of 4 and is still 2,216 tokens behind a
    assert [tenant_of(redis, raw) for raw, _ in claimer.claim(1, held={"a": 1, "b": 2})] == ["b"]
    # a waits below its share, but it is a whole job ahead in tokens: nobody gives way to it
    assert claimer.starved({"a": 1, "b": 3}) == ({"b": 1}, {})
