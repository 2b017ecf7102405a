"""A deterministic backend for unit tests of the worker loop: no model, no network.

Each step() emits one Token per running job: the words of its prompt (or of its last message), in
order, the first bare and the rest with a leading space. It honours max_tokens (finish 'length'),
stop strings (finish 'stop', text cut before the stop string) and cancel (finish 'cancelled').
Knobs for failure tests: `unavailable` (admit raises BackendUnavailable, probe() is False) and
`fail_after` (a job fails with a retryable error after that many tokens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from backends.base import BackendUnavailable, Done, Event, Failed, Token
from backends.chat.reasoning import first_stop
from backends.contract.schema import FinishReason, GenerateRequest, Sampling, SamplingDefaults
from backends.contract.settings import EngineSettings


class FakeSettings(EngineSettings):
    """`backend.type: fake` reads `slots`, `sampling` and its own pacing."""

    type: Literal["fake"] = "fake"
    step_delay: float = Field(0.0, ge=0, le=10, description="fake backend only: seconds each step takes "
                              "(paces test jobs like a real engine)")


@dataclass
class FakeJob:
    words: list[str]
    sampling: Sampling
    prompt_tokens: int
    text: str = ""
    emitted: int = 0
    cancelled: bool = False


class FakeBackend:

    def __init__(
        self,
        settings: FakeSettings | None = None,
        *,
        slots: int | None = None,
        fail_after: int | None = None,
        unavailable: bool = False,
        label: str = "fake",
        name: str = "fake",
    ) -> None:
        self.name = name  # what results record as the serving backend
        self.slots = slots or (settings.slots if settings else 4)
        self.defaults = settings.sampling if settings else SamplingDefaults.model_validate({})
        self.fail_after = fail_after
        self.unavailable = unavailable
        self.label = label  # tells fakes apart in fallback tests
        self.step_delay = settings.step_delay if settings else 0.0  # seconds per step, like a decode
        self.jobs: dict[str, FakeJob] = {}
        self.admitted: list[str] = []  # every job id ever admitted, in order
        self.closed = False

    def free_slots(self) -> int:
        return self.slots - len(self.jobs)

    def probe(self) -> bool:
        return not self.unavailable

    def admit(self, job_id: str, request: GenerateRequest) -> None:
        if self.unavailable:
            raise BackendUnavailable(f"{self.label} is unavailable")
        if job_id in self.jobs:
            raise ValueError(f"job {job_id} is already running on {self.label}")
        if not self.free_slots():
            raise RuntimeError(f"{self.label}: no free slot")
        source = request.prompt if request.prompt is not None else (request.messages or [])[-1].content
        words = source.split()
        self.jobs[job_id] = FakeJob(words, request.sampling(self.defaults), prompt_tokens=len(words))
        self.admitted.append(job_id)

    def step(self, timeout: float) -> list[Event]:
        if not self.jobs:
            time.sleep(max(0.0, timeout))  # like a real engine waiting for work
            return []
        if self.step_delay:
            time.sleep(self.step_delay)
        events: list[Event] = []
        for job_id, job in list(self.jobs.items()):
            produced = self._advance(job_id, job)
            if isinstance(produced[-1], Done | Failed):
                del self.jobs[job_id]
            events.extend(produced)
        return events

    def _advance(self, job_id: str, job: FakeJob) -> list[Event]:
        def done(reason: FinishReason, **extra: object) -> Done:
            return Done(job_id, reason, job.prompt_tokens, job.emitted, extra=extra)

        if job.cancelled:
            return [done("cancelled")]
        if self.fail_after is not None and job.emitted >= self.fail_after:
            return [Failed(job_id, f"{self.label} lost the job after {job.emitted} tokens", retryable=True)]
        if job.emitted >= len(job.words):
            return [done("stop")]
        word = job.words[job.emitted]
        piece = word if job.emitted == 0 else " " + word
        job.emitted += 1
        text = job.text + piece
        hit = first_stop(text, job.sampling.stop)
        if hit is not None:
            cut = text[len(job.text) : hit[0]]
            events: list[Event] = [Token(job_id, cut)] if cut else []
            return [*events, done("stop", stop_word=hit[1])]
        job.text = text
        if job.emitted >= job.sampling.max_tokens:
            return [Token(job_id, piece), done("length")]
        return [Token(job_id, piece)]

    def cancel(self, job_id: str) -> None:
        if job_id in self.jobs:
            self.jobs[job_id].cancelled = True

    def stats(self) -> dict[str, object]:
        return {"backend": self.name, "label": self.label, "slots": self.slots, "active": len(self.jobs)}

    def close(self) -> None:
        self.jobs.clear()
        self.closed = True
