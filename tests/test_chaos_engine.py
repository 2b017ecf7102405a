"""Chaos on the engine side: the llama-server a worker streams from is killed mid-run (SIGKILL)
and comes back a few seconds later on the same port. Jobs cut off are retried (attempt + 1) or
fail with a reason naming the engine; the worker stays up and serves new jobs afterwards. And a
fault inside the in-process engine hands its jobs back and leaves it clean."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest
from redis import Redis

from backends.base import Done, Failed, JobRejected, Token
from backends.contract.keys import worker_key
from backends.contract.schema import GenerateRequest
from backends.llamacpp import LlamaCppBackend
from backends.llamacpp.state import ActiveJob
from backends.llamacpp_settings import LlamaCppSettings
from dispatcher import Fleet, JobFailed
from ecosystem.local.llama_server import start_llama_server
from ecosystem.local.processes import free_port
from tests.reliability_checks import assert_exactly_one_final, fleet_workers, wait_streaming

pytestmark = [pytest.mark.timeout(240), pytest.mark.model]


def test_engine_killed_mid_run(redis_url: str, redis: Redis, tmp_path: Path) -> None:
    port = free_port()
    engine = start_llama_server(tmp_path / "engine", parallel=4, ctx=4096, threads=1, port=port)
    fleet = Fleet(redis_url)
    try:
        with fleet_workers(redis_url, tmp_path / "logs") as workers:
            worker = workers.start("e1", backend__type="llama-server", backend__endpoint=engine.url,
                                   backend__connect_timeout=5, max_attempts=3)
            jobs = [fleet.submit(prompt=f"List {i}: one,", max_tokens=48, temperature=0.0) for i in range(8)]
            cut_off = wait_streaming(redis, "e1", at_least=2)
            engine.kill()
            time.sleep(2)
            assert worker.alive() and redis.exists(worker_key("e1")), worker.output()
            engine = start_llama_server(tmp_path / "engine", parallel=4, ctx=4096, threads=1, port=port)

            outcomes: dict[str, dict | str] = {}
            for job in jobs:
                try:
                    outcomes[job.id] = job.result(timeout=150)
                except JobFailed as e:
                    outcomes[job.id] = e.error
            failed = {j: o for j, o in outcomes.items() if isinstance(o, str)}
            assert all("llama-server" in reason for reason in failed.values()), failed
            retried = [o for o in outcomes.values() if isinstance(o, dict) and o["attempt"] > 1]
            assert retried or failed, "killing the engine mid-run went unnoticed"
            assert all(isinstance(outcomes[j], dict) or j in failed for j in cut_off)
            assert_exactly_one_final(redis, [j.id for j in jobs])
            print(f"\nengine killed: {len(retried)} jobs retried and completed, {len(failed)} failed")

            # the same worker process serves on once its engine is back
            after = fleet.submit(prompt="After the crash:", max_tokens=8, temperature=0.0).result(timeout=60)
            assert after["worker"] == "e1" and after["usage"]["completion_tokens"] > 0
            assert worker.alive()
            assert "retrying it (attempt 2)" in worker.output()
    finally:
        engine.kill()


@pytest.fixture(scope="module")
def engine() -> Iterator[LlamaCppBackend]:
    """One in-process engine for the tests below: each leaves it as it found it (what they check:
    a fault or a refusal leaves the engine clean), so its model is loaded once."""
    shared = LlamaCppBackend(LlamaCppSettings(slots=4, n_ctx_per_seq=1024), threads=2)
    yield shared
    shared.close()


def test_an_engine_fault_hands_every_job_back_and_the_engine_starts_clean(engine: LlamaCppBackend) -> None:
    """A bug inside the in-process engine (here: the bookkeeper raising while a job starts, then
    a llama_decode wrapper raising mid-step) must not wedge it: every job in it fails retryably
    (the worker hands those back), the KV is emptied, and the next job answers as on a fresh
    engine."""
    ask = "The three primary colours are"
    faults = engine.faults  # the count stats() reports

    def run(job_id: str) -> str:
        engine.admit(job_id, GenerateRequest(prompt=ask, max_tokens=12, temperature=0.0))
        text = ""
        for _ in range(200):
            for ev in engine.step():
                if isinstance(ev, Token) and ev.job_id == job_id:
                    text += ev.text
                if isinstance(ev, Done) and ev.job_id == job_id:
                    return text
        raise AssertionError("the job never ended")

    before = run("before")
    for fault in ("admission", "step"):
        for i in range(2):
            request = GenerateRequest(prompt=f"{ask} {i}", max_tokens=50, temperature=0.0)
            engine.admit(f"{fault}{i}", request)
        engine.step()
        engine.step()

        def boom(*_: object) -> NoReturn:
            raise RuntimeError("a bug")

        if fault == "admission":
            engine.kv.reuse_prefix = boom  # type: ignore[method-assign, assignment]
            engine.admit(f"{fault}-new", GenerateRequest(prompt=ask, max_tokens=4))  # does not raise
        else:
            engine.executor.run = boom  # type: ignore[method-assign, assignment]
        failed = {ev.job_id for ev in engine.step() if isinstance(ev, Failed) and ev.retryable}
        starting = {f"{fault}-new"} if fault == "admission" else set()
        assert failed == {f"{fault}0", f"{fault}1", *starting}, fault
        stats = engine.stats()
        assert stats["active"] == stats["waiting"] == stats["prefixes"] == stats["ram_entries"] == 0
        assert engine.free_slots() == 4
        if fault == "step":
            del engine.executor.run  # the instance attribute: back to the method
        assert run(f"after-{fault}") == before  # nothing stale in the KV, no slot lost
    assert engine.stats()["faults"] == faults + 2


def test_a_job_its_own_grammar_refuses_at_the_start_fails_alone(engine: LlamaCppBackend) -> None:
    """A per-job refusal met while a job starts (its grammar sampler) fails that job, not the
    engine: the others go on, nothing is reset."""
    faults = engine.faults  # the count stats() reports
    opened = engine.executor.open

    def open_or_refuse(job: ActiveJob) -> None:
        if job.job_id == "bad":
            raise JobRejected("the grammar cannot be compiled")
        opened(job)

    engine.executor.open = open_or_refuse  # type: ignore[method-assign]
    try:
        engine.admit("good", GenerateRequest(prompt="Count: one, two,", max_tokens=8, temperature=0.0))
        engine.admit("bad", GenerateRequest(prompt="Count: one, two,", max_tokens=8))
        ends = {}
        for _ in range(100):
            ends.update({ev.job_id: ev for ev in engine.step() if isinstance(ev, Done | Failed)})
            if len(ends) == 2:
                break
        assert isinstance(ends["bad"], Failed) and not ends["bad"].retryable
        assert "grammar" in ends["bad"].error
        assert isinstance(ends["good"], Done)
        assert engine.stats()["faults"] == faults and engine.free_slots() == 4
    finally:
        del engine.executor.open  # the instance attribute: back to the method
