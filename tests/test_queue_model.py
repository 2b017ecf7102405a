"""The queue model as a state machine on a real redis-server: random sequences of admit + submit,
claim, start, end, every requeue path (engine failure, drain, put back, a dead worker's reaper),
cancel while queued (the fleet's and RQ's own) and batch lines, through the code the gateway,
producers and workers run; after every step the queue model's invariants
(backends/contract/queue/invariants.py) and the test's own bookkeeping of where each job is.

Also: the prelude's key names and queue rules agree with keys.py and the Python side."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from backends.base import Done
from backends.contract import keys, queue
from backends.contract.gateway_settings import FairTokens
from backends.contract.queue import fair
from backends.contract.queue.invariants import fair_spread_violations, queue_violations
from backends.contract.queue.scripts import PRELUDE
from dispatcher import Fleet
from dispatcher.gateway.batch.submit import BatchSpec, submit_batch
from dispatcher.plans import run
from dispatcher.tenants import LimitReached, Limits, NeverAdmitted, admit_plan
from tests.harness import RedisServer
from worker.assembly import job_hooks
from worker.claiming.claim import Claimer
from worker.job import ClaimedJob, Ending, unloaded
from worker.liveness.housekeeping import Housekeeper
from worker.liveness.reaper import Reaper
from worker.serving import endings, rqjobs

POOL = "llm"
TENANTS = ("default", "alpha", "beta")
LIMITS = {"alpha": Limits(max_concurrent=3, max_queued=2), "beta": Limits(requests_per_minute=1000)}
WORKERS = ("w1", "w2")
WEIGHTS = {"beta": 3.0}
_server: RedisServer | None = None


@pytest.fixture(scope="module", autouse=True)
def _redis_server(redis_server: RedisServer) -> Iterator[None]:
    global _server
    _server = redis_server
    yield
    _server = None


class QueueModel(RuleBasedStateMachine):
    """The test's own view: each live job is `queued` or held by a worker (claimed, then started)."""

    slots = 4  # each worker's, shared between the tenants

    def __init__(self) -> None:
        super().__init__()
        assert _server is not None
        self.redis: Redis = _server.client()
        self.redis.flushall()
        self.fleet = Fleet(_server.url)
        self.where: dict[str, str] = {}  # job id -> "queue" or a worker's name
        self.jobs: dict[str, ClaimedJob] = {}  # claimed jobs, loaded
        self.started: set[str] = set()
        self.ids = itertools.count()
        self.writers = {w: endings.AttemptWriter(self.redis, w, "fake", 600, job_hooks()) for w in WORKERS}
        self.claimers = {w: Claimer(self.redis, w, keys.queue_names(POOL), slots=self.slots, pool=POOL,
                                    weights=WEIGHTS) for w in WORKERS}
        self.largest_charge = 0.0  # of any job so far, over its tenant's weight (the fair share's bound)

    def teardown(self) -> None:
        self.redis.close()

    # -- producers ---------------------------------------------------------------------------------
    @rule(tenant=st.sampled_from(TENANTS), priority=st.sampled_from(("high", "default", "low")),
          n=st.integers(1, 3), words=st.sampled_from((1, 2, 300)), max_tokens=st.sampled_from((2, 64, None)))
    def submit(self, tenant: str, priority: str, n: int, words: int = 2, max_tokens: int | None = 2) -> None:
        ids = [f"{next(self.ids):032x}" for _ in range(n)]
        if tenant in LIMITS:
            try:
                run(self.redis, admit_plan(tenant, ids, LIMITS[tenant]))
            except (LimitReached, NeverAdmitted):
                return
        named = {} if tenant == "default" else {"tenant": tenant}
        for job_id in ids:
            self.fleet.submit(prompt=" ".join("ab"[i % 2] for i in range(words)), priority=priority,
                              job_id=job_id, max_tokens=max_tokens, **named)
            self.where[job_id] = "queue"

    @rule(n=st.integers(1, 3))
    def admit_and_the_gateway_dies(self, n: int) -> None:
        """Places admitted, and no enqueue follows (kill -9, or Redis gone between the two): a
        pending admission, not a leak (beta: its limit is per minute, so these places block none
        of the machine's later steps)."""
        run(self.redis, admit_plan("beta", [f"{next(self.ids):032x}" for _ in range(n)], LIMITS["beta"]))

    @rule(tenant=st.sampled_from(TENANTS), n=st.integers(1, 3))
    def submit_batch(self, tenant: str, n: int) -> None:
        spec = BatchSpec(batch_id=f"b{next(self.ids)}", pool=POOL,
                         tenant=None if tenant == "default" else tenant)
        lines = [f'{{"custom_id": "c{i}", "method": "POST", "url": "/v1/completions", '
                 f'"body": {{"model": "llm", "prompt": "x y", "max_tokens": 2}}}}' for i in range(n)]
        submit_batch(self.redis, spec, lambda: iter(lines))
        line_queue = keys.queue_key(queue.enqueue_target(f"{POOL}:low", spec.tenant)[0])
        for raw in self.redis.lrange(line_queue, 0, -1):
            job_id = raw.decode()
            self.where.setdefault(job_id, "queue")

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        waiting = sorted(j for j, w in self.where.items() if w == "queue")
        if not waiting:
            return
        job_id = data.draw(st.sampled_from(waiting))
        if data.draw(st.booleans()):
            assert self.fleet.job(job_id).cancel() == "cancelled"
        else:  # RQ's own cancel; a worker's housekeeping ends it
            Job.fetch(job_id, connection=self.redis, serializer=JSONSerializer).cancel()
            Housekeeper(self.redis, keys.queue_names(POOL), 600).run(force=True)
        del self.where[job_id]

    # -- workers -----------------------------------------------------------------------------------
    @rule(worker=st.sampled_from(WORKERS), n=st.integers(1, 4))
    def claim(self, worker: str, n: int) -> None:
        for raw, name in self.claimers[worker].claim(n):
            job_id = raw.decode()
            assert self.where.get(job_id) == "queue", f"claimed {job_id}, at {self.where.get(job_id)}"
            self.where[job_id] = worker
            self.jobs[job_id] = rqjobs.load(self.redis, job_id, name, 600, me=worker)

    def _held(self, worker: str | None = None) -> list[str]:
        return sorted(j for j, w in self.where.items() if w != "queue" and (worker is None or w == worker))

    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        todo = [j for j in self._held() if j not in self.started]
        if todo:
            job_id = data.draw(st.sampled_from(todo))
            assert self.writers[self.where[job_id]].start(self.jobs[job_id], 600)
            self.started.add(job_id)

    @rule(data=st.data(), prompt=st.sampled_from((1, 2, 400)), generated=st.sampled_from((0, 1, 64, 200)),
          cached=st.sampled_from((0, 1, 300)))
    def end(self, data: st.DataObject, prompt: int = 2, generated: int = 1, cached: int = 0) -> None:
        running = sorted(self.started)
        if not running:
            return
        job_id = data.draw(st.sampled_from(running))
        job, worker = self.jobs[job_id], self.where[job_id]
        done = Done(job_id, "stop", prompt, generated, min(cached, prompt))
        job.ending = endings.finished(job, done, time.monotonic(), worker, "fake")
        assert self.writers[worker].end([job]) == {job_id}
        self._gone(job_id)

    @rule(data=st.data())
    def fails_unloaded(self, data: st.DataObject) -> None:
        """A claimed job ended without its request read (the loop's internal error starting it, a
        record that does not load): the ending knows only its id and queue. Only before its start:
        a started job is in the loop's in-flight map, which ends it whole."""
        held = [j for j in self._held() if j not in self.started]
        if not held:
            return
        job_id = data.draw(st.sampled_from(held))
        worker = self.where[job_id]
        bare = unloaded(self.redis, job_id, self.jobs[job_id].queue, 1,
                   Ending(error="internal error starting the job"))
        assert self.writers[worker].end([bare]) == {job_id}
        self._gone(job_id)

    @rule(data=st.data(), how=st.sampled_from(("engine failure", "drain", "put back")))
    def requeue(self, data: st.DataObject, how: str) -> None:
        held = self._held()
        if not held:
            return
        job_id = data.draw(st.sampled_from(held))
        writer, job = self.writers[self.where[job_id]], self.jobs[job_id]
        if how == "put back":
            assert writer.put_back(job_id, job.queue) >= 0
        else:
            assert writer.requeue(job_id, job.queue, how, counted=how != "drain") >= 0
        self._back_in_line(job_id)

    @precondition(lambda self: self._held())
    @rule(worker=st.sampled_from(WORKERS))
    def worker_dies(self, worker: str) -> None:
        """The reaper of the other worker hands back (or fails, past max_attempts) what it held."""
        held = self._held(worker)
        other = next(w for w in WORKERS if w != worker)
        Reaper(self.redis, other, max_attempts=3, result_ttl=600).reap_worker(worker)
        for job_id in held:
            if self.redis.hget(keys.job_key(job_id), "status") == b"failed":
                self._gone(job_id)
            else:
                self._back_in_line(job_id)

    def _gone(self, job_id: str) -> None:
        del self.where[job_id]
        self.jobs.pop(job_id)
        self.started.discard(job_id)

    def _back_in_line(self, job_id: str) -> None:
        self.where[job_id] = "queue"
        self.jobs.pop(job_id)
        self.started.discard(job_id)

    # -- what must hold after every step -------------------------------------------------------------
    @invariant()
    def queue_model_holds(self) -> None:
        broken = queue_violations(self.redis)
        assert not broken, "\n".join(map(str, broken))

    @invariant()
    def no_tenant_runs_ahead_by_more_than_one_job(self) -> None:
        """The token counters: among the tenants with work at one pool and priority, none is
        ahead of the least served by more than the largest job charge over its weight."""
        for key in self.redis.scan_iter(match=keys.job_key("*")):
            charged, size, origin = self.redis.hmget(key, [keys.CHARGED_FIELD, keys.SIZE_FIELD, "origin"])
            if charged:  # claimed: what it was charged; queued: what it will be
                raw, weight = map(float, charged.split())
            else:
                raw = fair.size_charge((size or b"").decode(), FairTokens())
                weight = WEIGHTS.get(queue.split_queue((origin or b"").decode())[1], 1.0)
            self.largest_charge = max(self.largest_charge, raw / weight)
        broken = fair_spread_violations(self.redis, fair.spread_bound(self.largest_charge, self.slots > 0))
        assert not broken, "\n".join(map(str, broken))

    @invariant()
    def every_job_is_where_the_model_says(self) -> None:
        for worker in WORKERS:
            held = sorted(x.decode() for x in self.redis.lrange(keys.inflight_key(worker), 0, -1))
            assert held == self._held(worker)
        waiting = {j for j, w in self.where.items() if w == "queue"}
        in_queues = set()
        for key in self.redis.scan_iter(match=keys.queue_key(f"{POOL}:*")):
            in_queues |= {x.decode() for x in self.redis.lrange(key, 0, -1)}
        assert in_queues == waiting


QueueModel.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
test_queue_model = QueueModel.TestCase


class QueueModelClaimOrder(QueueModel):
    """The same on workers that share no slots (claim order only): no tenant is ever passed
    over, so the counters keep within one job's worth."""

    slots = 0


QueueModelClaimOrder.TestCase.settings = settings(max_examples=20, stateful_step_count=30, deadline=None,
                                                  suppress_health_check=[HealthCheck.too_slow])
test_queue_model_claim_order = QueueModelClaimOrder.TestCase


def test_a_tenants_job_the_reaper_gives_up_on_frees_its_places() -> None:
    """The machine's find, kept as a plain case: past max_attempts the reaper's ending counted the
    job as the default tenant's, so tenant alpha's open and queued places stayed taken."""
    state = QueueModel()
    try:
        state.submit(tenant="alpha", priority="high", n=1)
        for _ in range(3):
            state.claim(worker="w1", n=1)
            state.worker_dies(worker="w1")
        assert not state.where  # failed after its third attempt
        state.queue_model_holds()
    finally:
        state.teardown()


def test_the_prelude_names_keys_as_keys_py_does() -> None:
    """The Lua key functions are rendered from keys.py's; spot-check the text and the queue rule."""
    assert "queue = function(a0) return 'rq:queue:' .. a0 end" in PRELUDE
    assert "tenant_open = function(a0) return 'fleet:tenant:' .. a0 .. ':open' end" in PRELUDE
    for name, want in [("llm:default", ("llm:default", "default")), ("llm:low:team-b", ("llm:low", "team-b")),
                       ("llm:default:default", ("llm:default:default", "default")),
                       ("a:b:c", ("a:b:c", "default")), ("x:high:bad name", ("x:high:bad name", "default"))]:
        assert queue.split_queue(name) == want, name


def test_the_prelude_splits_queues_as_python_does(redis: Redis) -> None:
    names = ["llm:default", "llm:low:team-b", "llm:default:default", "a:b:c", "p:q:high:t.1", "llm:high:"]
    script = PRELUDE + "\nlocal out = {}\nfor i, n in ipairs(ARGV) do local b, t = split_queue(n); " \
                       "out[#out + 1] = b; out[#out + 1] = t end\nreturn out"
    flat: list[Any] = redis.eval(script, 0, *names)
    got = [(flat[i].decode(), flat[i + 1].decode()) for i in range(0, len(flat), 2)]
    assert got == [queue.split_queue(n) for n in names]


def test_a_place_admitted_but_never_enqueued_frees_itself_within_a_minute(redis: Redis,
                                                                          redis_url: str) -> None:
    """A gateway that dies between admission and enqueue holds the tenant's place for PENDING_MS,
    not for the job's lifetime; the enqueue confirms the place for the job's lifetime."""
    lost, kept = f"{1:032x}", f"{2:032x}"
    run(redis, admit_plan("t", [lost, kept], Limits(max_concurrent=5)))
    seconds, _ = redis.time()
    for job_id in (lost, kept):
        expiry = redis.zscore(keys.tenant_open_key("t"), job_id)
        assert expiry is not None and expiry <= seconds * 1000 + queue.PENDING_MS + 2000
    Fleet(redis_url).submit(prompt="a", max_tokens=2, tenant="t", job_id=kept, job_timeout=600)
    expiry = redis.zscore(keys.tenant_open_key("t"), kept)
    assert expiry is not None and expiry >= seconds * 1000 + queue.reservation_ms(None, 600) - 5000
    assert redis.pttl(keys.tenant_open_key("t")) >= queue.reservation_ms(None, 600) - 5000
    lost_expiry = redis.zscore(keys.tenant_open_key("t"), lost)
    assert lost_expiry is not None and lost_expiry <= seconds * 1000 + queue.PENDING_MS + 2000
    assert queue_violations(redis) == []  # pending, not leaked
    # the same place held for a job's lifetime by a job that does not exist is the leak
    redis.zadd(keys.tenant_open_key("t"), {lost: seconds * 1000 + queue.reservation_ms(None, 600)})
    assert [v.invariant for v in queue_violations(redis)] == ["places"]
