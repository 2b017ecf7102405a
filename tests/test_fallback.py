"""FallbackBackend: routing, failover with Restarted, health with exponential backoff, probes.
Pure unit tests over FakeBackends and a hand-moved clock."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from backends.base import Backend, BackendUnavailable, Done, Event, Failed, Restarted, Token
from backends.contract.schema import GenerateRequest
from backends.fake import FakeBackend
from backends.fallback import FallbackBackend, backoff_delay
from backends.registry import backend_settings, make_backend


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def chain(*fakes: FakeBackend, clock: Clock | None = None) -> FallbackBackend:
    def builder(f: FakeBackend) -> Callable[[], Backend]:
        def build() -> Backend:
            if f.unavailable:
                raise BackendUnavailable(f"{f.label} is down")
            return f

        return build

    return FallbackBackend(
        [(f.label, builder(f)) for f in fakes], clock=clock or Clock(), background_probes=False
    )


def run(backend: FallbackBackend, max_steps: int = 200) -> list[Event]:
    events: list[Event] = []
    for _ in range(max_steps):
        if not backend.stats()["active"]:
            break
        events += backend.step(0)
    return events


def member(backend: FallbackBackend, label: str) -> dict[str, object]:
    members = backend.stats()["members"]
    assert isinstance(members, list)
    return next(m for m in members if m["label"] == label)


def test_healthy_primary_takes_every_job() -> None:
    primary, spare = FakeBackend(slots=2, label="primary"), FakeBackend(slots=2, label="spare")
    fb = chain(primary, spare)
    assert fb.free_slots() == 2
    fb.admit("a", GenerateRequest(prompt="one two"))
    fb.admit("b", GenerateRequest(prompt="three"))
    assert fb.free_slots() == 0  # the spare is for failures, not for overflow
    events = run(fb)
    assert primary.admitted == ["a", "b"] and spare.admitted == []
    assert {e.job_id for e in events if isinstance(e, Done)} == {"a", "b"}
    assert member(fb, "primary")["healthy"] and member(fb, "spare")["healthy"]


def test_unreachable_primary_at_admit_sends_the_job_to_the_next_backend() -> None:
    clock = Clock()
    primary, spare = FakeBackend(label="primary"), FakeBackend(label="spare")
    fb = chain(primary, spare, clock=clock)
    primary.unavailable = True
    fb.admit("a", GenerateRequest(prompt="hello there"))
    assert spare.admitted == ["a"]
    state = member(fb, "primary")
    assert state["healthy"] is False and state["failures"] == 1 and state["retry_in"] == 1.0
    assert "primary is unavailable" in str(state["last_error"])
    assert fb.stats()["serving"] == "spare"
    events = run(fb)
    assert "".join(e.text for e in events if isinstance(e, Token)) == "hello there"


def test_a_job_failed_mid_stream_restarts_on_the_next_backend() -> None:
    primary = FakeBackend(label="primary", fail_after=2)
    spare = FakeBackend(label="spare")
    fb = chain(primary, spare)
    fb.admit("a", GenerateRequest(prompt="w1 w2 w3 w4"))
    events = run(fb)
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["Token", "Token", "Restarted", "Token", "Token", "Token", "Token", "Done"]
    restarted = events[2]
    assert isinstance(restarted, Restarted) and "primary lost the job" in restarted.reason
    assert "restarted on spare" in restarted.reason
    after = events[3:]
    assert "".join(e.text for e in after if isinstance(e, Token)) == "w1 w2 w3 w4"
    assert member(fb, "primary")["healthy"] is False


def test_done_names_the_backend_that_served_the_job() -> None:
    primary = FakeBackend(label="primary", name="llama-server", fail_after=1)
    spare = FakeBackend(label="spare", name="llama-cpp")
    fb = chain(primary, spare)
    fb.admit("a", GenerateRequest(prompt="x y"))
    events = run(fb)
    done = events[-1]
    assert isinstance(done, Done) and done.extra["backend"] == "llama-cpp"
    primary.fail_after = None
    fb.admit("b", GenerateRequest(prompt="x y"))
    assert isinstance(done := run(fb)[-1], Done) and done.extra["backend"] == "llama-cpp"  # primary rests


def test_no_restarted_event_when_the_failed_attempt_produced_nothing() -> None:
    fb = chain(FakeBackend(label="primary", fail_after=0), FakeBackend(label="spare"))
    fb.admit("a", GenerateRequest(prompt="x y"))
    events = run(fb)
    assert not any(isinstance(e, Restarted) for e in events)
    assert isinstance(events[-1], Done) and events[-1].finish_reason == "stop"


def test_every_backend_failing_gives_one_retryable_failure_naming_each() -> None:
    fb = chain(FakeBackend(label="p", fail_after=1), FakeBackend(label="s", fail_after=1))
    fb.admit("a", GenerateRequest(prompt="x y z"))
    events = run(fb)
    failed = [e for e in events if isinstance(e, Failed)]
    assert len(failed) == 1 and failed[0].retryable
    assert "p: p lost the job" in failed[0].error and "s: s lost the job" in failed[0].error
    assert fb.stats()["active"] == 0
    assert fb.free_slots() == 0  # nothing healthy left: claim nothing


def test_backoff_doubles_up_to_30s_and_a_probe_brings_the_backend_back() -> None:
    assert [backoff_delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    clock = Clock()
    primary, spare = FakeBackend(label="primary"), FakeBackend(label="spare")
    fb = chain(primary, spare, clock=clock)
    primary.unavailable = True
    fb.admit("a", GenerateRequest(prompt="x"))
    run(fb)
    for failures, wait in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0)]:
        assert member(fb, "primary")["failures"] == failures
        assert member(fb, "primary")["retry_in"] == wait
        clock.now += wait - 0.01
        fb.step(0)  # not due yet: no probe
        assert member(fb, "primary")["failures"] == failures
        clock.now += 0.01
        fb.step(0)  # due: probed, still down
    primary.unavailable = False
    clock.now += 16.0
    fb.step(0)
    assert member(fb, "primary")["healthy"] is True
    assert member(fb, "primary")["failures"] == 5  # kept until a job succeeds there
    fb.admit("b", GenerateRequest(prompt="back again"))
    assert primary.admitted == ["b"]
    run(fb)
    assert member(fb, "primary")["failures"] == 0


def test_one_outage_failing_many_jobs_counts_once() -> None:
    fb = chain(FakeBackend(slots=4, label="p", fail_after=1), FakeBackend(slots=4, label="s"))
    for i in range(4):
        fb.admit(f"j{i}", GenerateRequest(prompt="a b c"))
    events = run(fb)
    assert member(fb, "p")["failures"] == 1
    assert sum(isinstance(e, Done) for e in events) == 4
    assert sum(isinstance(e, Restarted) for e in events) == 4


def test_failed_over_jobs_wait_for_a_slot_on_a_smaller_fallback() -> None:
    primary = FakeBackend(slots=3, label="primary", fail_after=1)
    spare = FakeBackend(slots=1, label="spare")
    fb = chain(primary, spare)
    for i in range(3):
        fb.admit(f"j{i}", GenerateRequest(prompt="a b"))
    events = fb.step(0) + fb.step(0)  # one token each, then all three fail over
    assert fb.stats()["pending"] == 2 and spare.admitted == ["j0"]
    assert fb.free_slots() == 0
    fb.cancel("j2")  # cancelling a waiting job ends it at once
    events += run(fb)
    done = {e.job_id: e.finish_reason for e in events if isinstance(e, Done)}
    assert done == {"j0": "stop", "j1": "stop", "j2": "cancelled"}
    assert spare.admitted == ["j0", "j1"]


def test_cancel_reaches_the_backend_running_the_job() -> None:
    primary = FakeBackend(label="primary")
    fb = chain(primary, FakeBackend(label="spare"))
    fb.admit("a", GenerateRequest(prompt="a b c d e f"))
    fb.step(0)
    fb.cancel("a")
    events = run(fb)
    assert isinstance(events[-1], Done) and events[-1].finish_reason == "cancelled"
    assert member(fb, "primary")["healthy"] is True


def test_chain_starts_when_only_a_fallback_is_reachable_and_not_when_none_is() -> None:
    clock = Clock()
    primary, spare = FakeBackend(label="primary", unavailable=True), FakeBackend(label="spare")
    fb = chain(primary, spare, clock=clock)
    assert member(fb, "primary")["healthy"] is False and "primary is down" in str(
        member(fb, "primary")["last_error"]
    )
    fb.admit("a", GenerateRequest(prompt="x"))
    assert spare.admitted == ["a"]
    primary.unavailable = False
    clock.now += 1.0
    fb.step(0)  # the probe builds the backend that never came up
    assert member(fb, "primary")["healthy"] is True
    with pytest.raises(BackendUnavailable, match="no backend of the chain is reachable"):
        chain(FakeBackend(label="x", unavailable=True), FakeBackend(label="y", unavailable=True))


def test_make_backend_wraps_a_fallback_list() -> None:
    settings = backend_settings({"type": "fake", "slots": 2, "fallback": [{"type": "fake", "slots": 5}]})
    backend = make_backend(settings)
    assert isinstance(backend, FallbackBackend)
    assert backend.name == "fake>fake"  # the chain, as `fleet status` shows it
    members = backend.stats()["members"]
    assert isinstance(members, list) and [m["label"] for m in members] == ["fake@default", "fake@default"]
    assert backend.free_slots() == 2 and backend.slots == 5
    backend.close()
