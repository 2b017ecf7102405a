"""Reading llama-server's SSE chunks into a job's events: `/completion`'s and
`/v1/chat/completions`' (its text, or with a job in the server's own dialect its parsed deltas
as the answer JSON: backends/chat/openai_deltas.py), their usage, timings and logprobs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from backends.base import Done, Event, Token
from backends.chat.openai_deltas import DeltaAnswer
from backends.contract.schema import FinishReason


def cache_hits(timings: object) -> int:
    """The prompt tokens llama-server found in its cache and did not prefill: its timings'
    `cache_n`, on both endpoints (the chat endpoint's usage.prompt_tokens_details.cached_tokens
    says the same)."""
    return int(timings.get("cache_n") or 0) if isinstance(timings, dict) else 0


class LogprobsCollector:
    """Per-token log-probabilities from llama-server's chunks, kept in OpenAI's chat shape
    ([{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]) for the result."""

    def __init__(self, top: int | None) -> None:
        self.top = top or 0
        self.tokens: list[dict[str, Any]] = []

    def add(self, entries: object) -> None:
        for e in entries if isinstance(entries, list) else []:
            tops = e.get("top_logprobs") or []
            self.tokens.append({"token": e.get("token", ""), "logprob": e.get("logprob"),
                                "bytes": e.get("bytes"),
                                "top_logprobs": [{k: t.get(k) for k in ("token", "logprob", "bytes")}
                                                 for t in tops[: self.top]]})

    def extra(self) -> dict[str, Any]:
        return {"logprobs": self.tokens} if self.tokens else {}


class CompletionChunkReader:
    """Reads `/completion` SSE chunks: {"content", "stop": false} ... then {"stop": true, ...usage}."""

    def __init__(self, job_id: str, top_logprobs: int | None = None) -> None:
        self.job_id = job_id
        self.done: Done | None = None
        self.logprobs = LogprobsCollector(top_logprobs)

    def feed(self, chunk: dict[str, Any]) -> Iterator[Event]:
        self.logprobs.add(chunk.get("completion_probabilities"))
        if chunk.get("content"):
            yield Token(self.job_id, chunk["content"])
        if chunk.get("stop"):
            stop_type = chunk.get("stop_type")
            finish: FinishReason = "length" if stop_type == "limit" or chunk.get("truncated") else "stop"
            self.done = Done(
                self.job_id,
                finish,
                prompt_tokens=int(chunk.get("tokens_evaluated") or 0),
                completion_tokens=int(chunk.get("tokens_predicted") or 0),
                cached_tokens=cache_hits(chunk.get("timings")),
                extra={
                    "timings": chunk.get("timings", {}),
                    "stop_type": stop_type,
                    **({"stop_word": chunk["stopping_word"]} if stop_type == "word" else {}),
                    "tokens_cached": chunk.get("tokens_cached", 0),
                    **self.logprobs.extra(),
                },
            )

    def finish(self) -> None:
        """The stream ended without a `stop: true` chunk: it was cut (leaves `done` unset)."""


class ChatChunkReader:
    """Reads `/v1/chat/completions` chunks: deltas, a chunk with finish_reason, then a usage chunk.
    With `answer`, the deltas (words, thoughts, calls the server parsed) stream as the answer
    JSON; the answer may end before the server's stream does (its last allowed call, or a call
    repeated): then `done` is set at once, with the tokens the chunks' timings counted."""

    def __init__(self, job_id: str, top_logprobs: int | None = None,
                 answer: DeltaAnswer | None = None) -> None:
        self.job_id = job_id
        self.done: Done | None = None
        self.logprobs = LogprobsCollector(top_logprobs)
        self.answer = answer
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] = {}
        self.timings: dict[str, Any] = {}

    def feed(self, chunk: dict[str, Any]) -> Iterator[Event]:
        for choice in chunk.get("choices") or []:
            self.logprobs.add((choice.get("logprobs") or {}).get("content"))
            delta = choice.get("delta") or {}
            text = self.answer.feed(delta) if self.answer is not None else delta.get("content")
            if text:
                yield Token(self.job_id, text)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if chunk.get("timings"):
            self.timings = chunk["timings"]
        if self.answer is not None:
            cut = self.answer.ended and self.finish_reason is None
            if (cut or self.finish_reason is not None) and (end := self.answer.close()):
                yield Token(self.job_id, end, n_tokens=0)  # once; the object's end is no token of the model's
            if cut:
                self.finish_reason = "stop"
                self.finish()
        if chunk.get("usage"):
            self.usage = chunk["usage"]
            self.finish()

    def finish(self) -> None:
        """At [DONE], the usage chunk, or the answer's end; without a finish_reason the stream
        was cut."""
        if self.finish_reason is None:
            return
        timings = self.timings
        counted = int(timings.get("prompt_n") or 0) + cache_hits(timings)
        self.done = Done(
            self.job_id,
            "length" if self.finish_reason == "length" else "stop",
            prompt_tokens=int(self.usage.get("prompt_tokens") or counted),
            completion_tokens=int(self.usage.get("completion_tokens") or timings.get("predicted_n") or 0),
            cached_tokens=cache_hits(timings),
            extra={"timings": timings, "server_finish_reason": self.finish_reason, **self.logprobs.extra()},
        )
