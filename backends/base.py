"""The backend protocol: what a worker asks of an engine, and what the engine answers.

This module must stay importable without llama_cpp: producers validate requests with it.

A backend holds up to `slots` jobs at once. The worker `admit`s jobs while `free_slots() > 0`,
calls `step()` in a loop and turns the events it returns into Redis writes:

    Token  -> a text delta for the job's stream
    Done   -> the job finished (stop, length, cancelled); its slot is free again
    Failed -> the job failed; `retryable` says the engine (not the job) was at fault,
              so the worker may try it on a fallback backend
    Restarted -> partial output so far is void (the job restarted on another engine)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_TOKENS_LIMIT = 8192
MAX_PROMPT_CHARS = 1_000_000
# All of a request's text together (prompt, or every message): 256 messages of MAX_PROMPT_CHARS
# each would otherwise pass (issue 10, defect 7). Workers bound it further by their context.
MAX_REQUEST_CHARS = 1_000_000
MAX_SCHEMA_CHARS = 32_768  # a JSON schema for structured output, serialized
MAX_TOP_LOGPROBS = 20
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
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)


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
    # OpenAI's additive penalties (llama.cpp's penalties sampler): a token already generated
    # loses presence_penalty once, and frequency_penalty per time it occurred
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, lt=2**32)
    stop: list[str] = Field(default_factory=list, max_length=16)
    # per-token log-probabilities of the sampled tokens; top_logprobs: that many alternatives too
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # structured output: "json" = any JSON object; a dict = a JSON Schema the text must match
    format: Literal["json"] | dict[str, Any] | None = None

    @field_validator("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                     "frequency_penalty", mode="before")
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

    @field_validator("format")
    @classmethod
    def _json_schema(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(v, dict):
            check_json_schema(v)
        return v

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> GenerateRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError("prompt is empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        total = sum(len(m.content) for m in self.messages or [])
        if total > MAX_REQUEST_CHARS:
            limit = MAX_REQUEST_CHARS
            raise ValueError(f"messages hold {total:,} characters together; the limit is {limit:,}")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def sampling(self, defaults: SamplingDefaults) -> Sampling:
        """The request's sampling values with the worker's defaults filled in."""
        d = defaults.model_dump()
        for k in d:
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        return Sampling(**d, seed=self.seed, stop=list(self.stop))


def check_json_schema(schema: dict[str, Any]) -> None:
    """ValueError naming the problem unless `schema` is a usable JSON Schema (any draft
    jsonschema knows; `$schema` picks it, else 2020-12)."""
    from jsonschema import exceptions, validators

    if len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
        raise ValueError(f"the JSON schema is longer than {MAX_SCHEMA_CHARS} characters")
    try:
        validators.validator_for(schema).check_schema(schema)
    except exceptions.SchemaError as e:
        where = "/".join(str(p) for p in e.path) or "(root)"
        raise ValueError(f"not a valid JSON schema at {where}: {e.message}") from None


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int | None
    stop: list[str]


# -- events a backend returns from step() ---------------------------------------------------------


@dataclass
class Token:
    job_id: str
    text: str
    n_tokens: int = 1


@dataclass
class Done:
    job_id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    extra: dict[str, object] = field(default_factory=dict)


@dataclass
class Failed:
    job_id: str
    error: str
    retryable: bool = False  # the engine failed (transport, crash), not the job itself


@dataclass
class Restarted:
    """The job's partial output is void: the engine restarted it (e.g. on a fallback backend)."""

    job_id: str
    reason: str


Event = Token | Done | Failed | Restarted


class JobRejected(Exception):
    """The job can never run on this backend (e.g. prompt longer than the context)."""


class BackendUnavailable(Exception):
    """The engine cannot be reached; the job may run elsewhere."""


@runtime_checkable
class Backend(Protocol):
    name: str
    slots: int

    def free_slots(self) -> int: ...

    def admit(self, job_id: str, request: GenerateRequest) -> None:
        """Start a job. Raises JobRejected / BackendUnavailable; never blocks for long."""

    def step(self, timeout: float) -> list[Event]:
        """Advance all admitted jobs a little; wait at most `timeout` seconds for events."""

    def cancel(self, job_id: str) -> None:
        """Stop a job; a Done(finish_reason='cancelled') follows from a later step()."""

    def stats(self) -> dict[str, object]: ...

    def close(self) -> None: ...
