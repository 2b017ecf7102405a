"""FakeBackend: deterministic enough for the worker-loop tests that rely on it."""

from __future__ import annotations

import pytest

from backends.base import Backend, Done, Event, Token
from backends.contract.schema import GenerateRequest, Message
from backends.fake import FakeBackend, FakeSettings
from backends.registry import make_backend


def run(backend: FakeBackend, max_steps: int = 100) -> list[Event]:
    events: list[Event] = []
    for _ in range(max_steps):
        if not backend.jobs:
            break
        events += backend.step(0)
    return events


def text_of(events: list[Event], job_id: str) -> str:
    return "".join(e.text for e in events if isinstance(e, Token) and e.job_id == job_id)


def done_of(events: list[Event], job_id: str) -> Done:
    (done,) = [e for e in events if isinstance(e, Done) and e.job_id == job_id]
    return done


def test_echoes_the_prompt_one_token_per_step_per_job() -> None:
    fake = FakeBackend(slots=2)
    assert isinstance(fake, Backend)
    fake.admit("a", GenerateRequest(prompt="one two three"))
    fake.admit("b", GenerateRequest(messages=[Message(role="user", content="red green")]))
    assert fake.free_slots() == 0
    first = fake.step(0)
    assert [(e.job_id, e.text) for e in first if isinstance(e, Token)] == [("a", "one"), ("b", "red")]
    events = first + run(fake)
    assert text_of(events, "a") == "one two three"
    assert text_of(events, "b") == "red green"
    assert done_of(events, "a") == Done("a", "stop", prompt_tokens=3, completion_tokens=3)
    assert fake.free_slots() == 2


def test_max_tokens_stop_strings_and_cancel() -> None:
    fake = FakeBackend(slots=3)
    fake.admit("len", GenerateRequest(prompt="a b c d e", max_tokens=2))
    fake.admit("stop", GenerateRequest(prompt="alpha beta gamma delta", stop=["delta", "mma"]))
    fake.admit("cancel", GenerateRequest(prompt="x y z w"))
    events = fake.step(0)
    fake.cancel("cancel")
    events += run(fake)
    assert text_of(events, "len") == "a b" and done_of(events, "len").finish_reason == "length"
    assert done_of(events, "len").completion_tokens == 2
    assert text_of(events, "stop") == "alpha beta ga" and done_of(events, "stop").finish_reason == "stop"
    assert done_of(events, "stop").extra == {"stop_word": "mma"}  # the one met, not the one listed first
    assert text_of(events, "cancel") == "x" and done_of(events, "cancel").finish_reason == "cancelled"


def test_admit_beyond_slots_and_unavailable_raise() -> None:
    fake = FakeBackend(slots=1)
    fake.admit("a", GenerateRequest(prompt="hi"))
    with pytest.raises(RuntimeError):
        fake.admit("b", GenerateRequest(prompt="hi"))
    fake.unavailable = True
    assert fake.probe() is False


def test_make_backend_builds_a_fake_from_settings() -> None:
    backend = make_backend(FakeSettings(slots=3))
    assert isinstance(backend, FakeBackend) and backend.slots == 3
