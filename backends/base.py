"""The backend protocol: what a worker asks of an engine, and what the engine answers.

Importable without llama_cpp. Requests, sampling and results: backends/contract/schema.py.

A backend holds up to `slots` jobs at once. The worker `admit`s jobs while `free_slots() > 0`,
calls `step()` in a loop and turns the events it returns into Redis writes:

    Token  -> a text delta for the job's stream
    Done   -> the job finished (stop, length, cancelled); its slot is free again
    Failed -> the job failed; `retryable` says the engine (not the job) was at fault,
              so the worker may try it on a fallback backend
    Restarted -> partial output so far is void (the job restarted on another engine)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from backends.contract.schema import FinishReason, GenerateRequest, Sampling
from backends.contract.text_ops import TextRequest

# The request types in the protocol's signatures, importable from here too (defined in the contract)
__all__ = ["Backend", "BackendUnavailable", "Done", "Embedder", "Embedding", "Event", "Failed",
           "FinishReason", "GenerateRequest", "InputRejected", "JobRejected", "Restarted", "Sampling",
           "Scorer", "Scores", "TextOps", "TextRequest", "Token"]

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
    # of prompt_tokens, those the engine did not prefill: their KV was there already (a cache)
    cached_tokens: int = 0
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


class InputRejected(JobRejected):
    """One input of an embedding call can never be embedded here (`index`: which, in the call)."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index = index


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

    def probe(self) -> bool:
        """True when the engine answers now (a fallback chain asks before trusting it again)."""

    def stats(self) -> dict[str, object]: ...

    def close(self) -> None: ...


@runtime_checkable
class Resumable(Protocol):
    """An engine that can start a job again where a dead attempt left it (the in-process one)."""

    def resume(self, job_id: str, request: GenerateRequest, delivered: str) -> bool:
        """Admit the job to continue after `delivered` (the text its last attempt wrote); False
        when this request cannot resume (the caller admits it to start over)."""


@runtime_checkable
class Bilingual(Protocol):
    """An engine whose model speaks its own dialect (its Jinja template with tools, its call
    syntax, its thoughts: backends/chat): it takes a chat as sent where it can, not lowered to the
    generic tool format."""

    def speaks(self, request: GenerateRequest) -> bool:
        """Whether this request runs as sent (else the worker lowers it first)."""


@runtime_checkable
class Described(Protocol):
    """An engine that can describe its model (backends/model_card.py): what the worker publishes
    for the gateway's Ollama `/api/show`."""

    def model_card(self) -> dict[str, object]:
        """The model card (JSON-serialisable); read once, at the worker's start."""


@dataclass
class Embedding:
    vector: Sequence[float]  # as the model pooled it (the worker cuts and normalises)
    tokens: int  # the input's tokens, as embedded (after a cut to fit)


@runtime_checkable
class Embedder(Protocol):
    """An engine that embeds text too. The worker calls `embed` between generation steps with up
    to `embed_batch` inputs (of one or several jobs), in one batch where the engine can."""

    embed_batch: int

    def embed(self, texts: Sequence[str], truncate: Sequence[bool]) -> list[Embedding]:
        """One vector per text, in order; `truncate[i]`: cut text i to the engine's embedding
        context instead of refusing it. Raises InputRejected (that input never fits),
        JobRejected (this engine cannot embed), BackendUnavailable."""


@dataclass
class Scores:
    """What one scoring call gave (backends/contract/rerank.py)."""

    # P("yes") / (P("yes") + P("no")) of the first documents, in order (a call may score fewer
    # than it was given: Scorer.score)
    relevance: list[float]
    tokens: list[int]  # each scored document's own tokens (with the prompt's closing)
    prefix_tokens: int  # the instruction-and-query prefix's tokens, shared by the documents
    prefilled: int  # tokens this call decoded: the documents', and the prefix's unless held


@runtime_checkable
class Scorer(Protocol):
    """An engine that scores documents against a query (rerank jobs). The worker calls `score`
    between generation steps with up to `score_batch` documents of one job; calls for the same
    query and instruction in a row reuse the prefix they share."""

    score_batch: int

    def score(self, query: str, instruction: str, documents: Sequence[str]) -> Scores:
        """Scores of the first documents, in order: all of them, or as many as one bounded pass
        of the engine takes (at least one; the caller sends the rest again). Raises
        InputRejected (document `index` never fits; -1: the query and instruction alone do
        not), JobRejected (this engine cannot score), BackendUnavailable."""


@runtime_checkable
class TextOps(Protocol):
    """An engine that answers text jobs (backends/contract/text_ops.py) with its model's tokenizer
    and chat template: llama-server's /tokenize, /detokenize and /apply-template. The worker calls
    it on a thread of its own while the loop steps the engine (worker/serving/text_jobs.py), so it
    reads only what a step never changes: the vocabulary and the template (no decode)."""

    def text_op(self, request: TextRequest) -> dict[str, object]:
        """The body llama-server answers for the same request. Raises JobRejected (the request
        cannot be answered by this model, or this engine does not do it), BackendUnavailable."""
