"""What a job is and what it returns: the request producers send (validated on both sides), the
sampling values a backend runs with, and the one result object every finished job gets.

Importable without llama_cpp and without Redis: producers, workers and backends all use it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_TOKENS_LIMIT = 8192
MAX_PROMPT_CHARS = 1_000_000
Priority = Literal["high", "default", "low"]
PRIORITIES: tuple[Priority, ...] = ("high", "default", "low")
FinishReason = Literal["stop", "length", "cancelled"]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=MAX_PROMPT_CHARS)


class SamplingDefaults(BaseModel):
    """Sampling values a worker uses for fields a request leaves out."""

    model_config = ConfigDict(extra="forbid")
    max_tokens: int = Field(128, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(0.8, ge=0.0, le=5.0)
    top_k: int = Field(40, ge=0, le=1000)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    min_p: float = Field(0.05, ge=0.0, le=1.0)
    repeat_penalty: float = Field(1.0, gt=0.0, le=5.0)


class GenerateRequest(BaseModel):
    """One generation job, as a producer sends it. Unset sampling fields take the worker's defaults."""

    model_config = ConfigDict(extra="forbid", strict=True)
    prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    messages: list[Message] | None = Field(None, max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=5.0)
    top_k: int | None = Field(None, ge=0, le=1000)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(None, gt=0.0, le=5.0)
    seed: int | None = Field(None, ge=0, lt=2**32)
    stop: list[str] = Field(default_factory=list, max_length=16)

    @field_validator("temperature", "top_p", "min_p", "repeat_penalty", mode="before")
    @classmethod
    def _int_is_a_float(cls, v: object) -> object:
        # strict mode refuses 1 for a float field; JSON producers write 1 for 1.0
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: list[str]) -> list[str]:
        if any(not s or len(s) > 256 for s in v):
            raise ValueError("stop strings must be 1..256 characters")
        return v

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> GenerateRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError("prompt is empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        return self

    def sampling(self, defaults: SamplingDefaults) -> Sampling:
        """The request's sampling values with the worker's defaults filled in."""
        d = defaults.model_dump()
        for k in d:
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        return Sampling(**d, seed=self.seed, stop=list(self.stop))


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    seed: int | None
    stop: list[str]


def describe_validation_error(e: ValidationError) -> str:
    """pydantic's errors as one line a producer understands: `field: message; ...` (first five)."""
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "request"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


# -- the result ------------------------------------------------------------------------------------


class _ReadsLikeADict(BaseModel):
    """Attribute access (`res.text`) and, for code written against the plain dict RQ stores,
    read-only mapping access (`res["text"]`, `res.get(...)`, `dict(res)`, `res == {...}`).
    The mapping shows the fields the worker sent (a newer worker's extra fields included)."""

    model_config = ConfigDict(extra="allow")

    def _as_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True)

    def __getitem__(self, key: str) -> Any:
        if key not in self.model_fields_set and key not in (self.model_extra or {}):
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def keys(self) -> list[str]:
        return list(self._as_dict())

    def items(self) -> list[tuple[str, Any]]:
        return [(k, self[k]) for k in self.keys()]

    def __contains__(self, key: object) -> bool:
        return key in self._as_dict()

    def __iter__(self) -> Iterator[str]:  # type: ignore[override]  # a mapping iterates its keys
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._as_dict())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._as_dict() == dict(other)
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dict it stands for


class Usage(_ReadsLikeADict):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class Timings(_ReadsLikeADict):
    queue_ms: float | None = None  # enqueued -> claimed
    ttft_ms: float | None = None  # claimed -> first token
    total_ms: float | None = None  # claimed -> done
    tokens_per_s: float | None = None  # completion tokens / (first token -> done)


class JobResult(_ReadsLikeADict):
    """What a finished (or cancelled) job returns: `FleetJob.result()` gives this object; RQ stores
    `model_dump()` (a plain JSON dict) as the job's return value and the stream's final entry
    carries the same dict. Build one with `job_result()` / `cancelled_in_queue()`."""

    job_id: str = ""
    text: str = ""
    finish_reason: FinishReason = "stop"
    usage: Usage = Field(default_factory=Usage)
    worker: str | None = None
    backend: str | None = None
    attempt: int = 1
    timings: Timings = Field(default_factory=Timings)


def job_result(job_id: str, text: str, finish_reason: FinishReason, *, prompt_tokens: int,
               completion_tokens: int, worker: str | None, backend: str | None, attempt: int,
               queue_ms: float | None = None, ttft_ms: float | None = None, total_ms: float | None = None,
               tokens_per_s: float | None = None) -> JobResult:
    """The one place a job's result is put together (times rounded to 0.1)."""
    return JobResult(
        job_id=job_id,
        text=text,
        finish_reason=finish_reason,
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                    total_tokens=prompt_tokens + completion_tokens),
        worker=worker,
        backend=backend,
        attempt=attempt,
        timings=Timings(queue_ms=_round(queue_ms), ttft_ms=_round(ttft_ms), total_ms=_round(total_ms),
                        tokens_per_s=_round(tokens_per_s)),
    )


def cancelled_in_queue(job_id: str, attempt: int) -> JobResult:
    """The result of a job cancelled before any worker ran it."""
    return job_result(job_id, "", "cancelled", prompt_tokens=0, completion_tokens=0, worker=None,
                      backend=None, attempt=attempt)


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)
