"""OverlappedBackend: the next step runs while the caller handles the last one's events."""

from __future__ import annotations

import threading

import pytest

from backends.base import Backend, Done, Event, Token
from backends.contract.schema import GenerateRequest
from backends.fake import FakeBackend
from backends.overlap import OverlappedBackend


class GatedFake(FakeBackend):
    """A fake whose steps wait at a gate, so a test sees what happens while one is in flight."""

    def __init__(self, slots: int) -> None:
        super().__init__(slots=slots)
        self.gate = threading.Semaphore(0)
        self.entered = 0  # steps begun
        self.changed = threading.Condition()
        self.threads: set[str] = set()
        self.fail_next = False

    def step(self, timeout: float) -> list[Event]:
        with self.changed:
            self.entered += 1
            self.changed.notify_all()
        self.gate.acquire()
        self.threads.add(threading.current_thread().name)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("decode failed")
        return super().step(timeout)

    def wait_entered(self, n: int) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.entered >= n, timeout=5)


def test_same_events_as_the_engine_alone_one_step_later() -> None:
    serial, inner = FakeBackend(slots=3), FakeBackend(slots=3)
    over = OverlappedBackend(inner)
    prompts = {"a": "one two three four", "b": "red green", "c": "x y z"}
    for job, prompt in prompts.items():
        serial.admit(job, GenerateRequest(prompt=prompt))
        over.admit(job, GenerateRequest(prompt=prompt))
    assert over.free_slots() == 0
    expected: list[Event] = []
    while serial.jobs:
        expected += serial.step(0)
    got: list[Event] = []
    for _ in range(50):
        got += over.step(0.01)
        if len(got) >= len(expected):
            break
    assert got == expected
    assert over.free_slots() == 3
    over.close()
    assert inner.closed


def test_the_next_step_runs_while_the_caller_holds_the_last_events() -> None:
    inner = GatedFake(slots=2)
    over = OverlappedBackend(inner)
    over.admit("a", GenerateRequest(prompt="alpha beta gamma"))
    inner.gate.release()  # lets the first step through
    first = over.step(0.01)  # waits for it (nothing was in flight), launches the second
    assert [(e.job_id, e.text) for e in first if isinstance(e, Token)] == [("a", "alpha")]
    assert inner.wait_entered(2)  # ... which is running now, on the helper thread

    # a job admitted while a step runs waits for that step: the engine is never entered twice
    admitted = threading.Event()

    def admit_b() -> None:
        over.admit("b", GenerateRequest(prompt="red green"))
        admitted.set()

    admitter = threading.Thread(target=admit_b)
    admitter.start()
    assert not admitted.wait(0.3)
    assert over.free_slots() == 1  # the count taken when the engine was last still
    inner.gate.release()
    assert admitted.wait(5)
    admitter.join()
    assert over.free_slots() == 0

    for _ in range(20):
        inner.gate.release()
    events = first + over.step(0.01)
    while sum(isinstance(e, Done) for e in events) != 2:
        events += over.step(0.01)
    assert "".join(e.text for e in events if isinstance(e, Token) and e.job_id == "a") == "alpha beta gamma"
    assert "".join(e.text for e in events if isinstance(e, Token) and e.job_id == "b") == "red green"
    assert inner.threads and all(name.startswith("fake-step") for name in inner.threads)
    for _ in range(5):
        inner.gate.release()
    over.close()


def test_an_engine_error_is_raised_by_the_next_call_and_the_backend_goes_on() -> None:
    inner = GatedFake(slots=1)
    over = OverlappedBackend(inner)
    over.admit("a", GenerateRequest(prompt="one two"))
    for _ in range(50):
        inner.gate.release()
    inner.fail_next = True
    with pytest.raises(RuntimeError, match="decode failed"):
        over.step(0.01)
    events: list[Event] = []
    while not any(isinstance(e, Done) for e in events):
        events += over.step(0.01)
    assert "".join(e.text for e in events if isinstance(e, Token)) == "one two"
    over.close()


def test_cancel_waits_for_the_step_and_its_done_follows() -> None:
    inner = FakeBackend(slots=1)
    over = OverlappedBackend(inner)
    over.admit("a", GenerateRequest(prompt="a b c d e f g h"))
    events = over.step(0.01)
    over.cancel("a")
    while not any(isinstance(e, Done) for e in events):
        events += over.step(0.01)
    (done,) = [e for e in events if isinstance(e, Done)]
    assert done.finish_reason == "cancelled"
    assert over.free_slots() == 1
    over.close()


@pytest.mark.model
def test_on_the_real_engine_the_text_is_the_serial_engines() -> None:
    """`backend.overlap: true` on llama.cpp: the same greedy text as stepping the engine in turn."""
    from backends.llamacpp import LlamaCppBackend
    from backends.llamacpp_settings import LlamaCppSettings
    from backends.registry import make_backend
    from tests.engine_state import fixed_clock

    prompts = [f"List three facts about {t}." for t in ("tides", "bees", "glass", "copper")]

    def texts(backend: Backend) -> dict[str, str]:
        for i, p in enumerate(prompts):
            backend.admit(f"j{i}", GenerateRequest(prompt=p, max_tokens=24, temperature=0.0))
        out = dict.fromkeys((f"j{i}" for i in range(len(prompts))), "")
        ended: set[str] = set()
        while len(ended) < len(prompts):
            for ev in backend.step(0.05):
                if isinstance(ev, Token):
                    out[ev.job_id] += ev.text
                elif isinstance(ev, Done):
                    ended.add(ev.job_id)
        backend.close()
        return out

    # the same calls in both engines on any CPU (tests/engine_state.py): no pacing, and drafts
    # sized by a stand-in clock, not by each engine's own timings
    settings = LlamaCppSettings(slots=4, n_ctx_per_seq=256, prefix_cache=0, overlap=True, max_stall_ms=0)
    overlapped = make_backend(settings, threads=2)
    assert isinstance(overlapped, OverlappedBackend) and isinstance(overlapped.inner, LlamaCppBackend)
    fixed_clock(overlapped.inner)
    got = texts(overlapped)
    assert all(got.values()), got
    serial = LlamaCppBackend(settings, threads=2)
    fixed_clock(serial)
    assert got == texts(serial)
