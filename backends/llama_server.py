"""llama.cpp's `llama-server` over HTTP: one SSE stream per job, as many jobs as the server has slots.

Prompt jobs go to the native `/completion` (raw text, like the in-process backend); message jobs go
to `/v1/chat/completions`, where the server applies the model's chat template. Usage and timings
come from the server's final chunk.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
from httpx_sse import connect_sse

from backends.base import BackendUnavailable, Done, Event, Token
from backends.contract.schema import FinishReason, GenerateRequest, Sampling
from backends.http_pool import HttpStreamBackend, StreamFailure, StreamJob, sampler_fields
from backends.http_settings import HttpSettings


class LlamaServerBackend(HttpStreamBackend):
    name = "llama-server"
    health_path = "/health"  # 503 while the model loads

    def __init__(self, settings: HttpSettings, *, transport: httpx.BaseTransport | None = None) -> None:
        super().__init__(settings, "llama-server", transport)
        self.server_slots = 0
        self._start()

    def _discover_slots(self) -> int:
        self.server_slots = self._server_slots()
        return min(self.server_slots, self.settings.parallel or self.server_slots)

    def _server_slots(self) -> int:
        """The server's `--parallel`: total_slots from /props, else the length of /slots."""
        try:
            props = self._ask("GET", "/props")
            if props.status_code == 200 and isinstance(props.json().get("total_slots"), int):
                return max(1, int(props.json()["total_slots"]))
            slots = self._ask("GET", "/slots")
            if slots.status_code == 200 and isinstance(slots.json(), list):
                return max(1, len(slots.json()))
        except (httpx.HTTPError, ValueError) as e:
            raise BackendUnavailable(f"{self.what}: cannot read its slot count: {e}") from e
        raise BackendUnavailable(f"{self.what}: neither /props nor /slots gives a slot count")

    def stats(self) -> dict[str, object]:
        return {**super().stats(), "server_slots": self.server_slots}

    # -- one job ------------------------------------------------------------------------------------

    def _stream(self, job: StreamJob) -> Iterator[Event]:
        s = job.sampling
        reader: ChatChunkReader | CompletionChunkReader
        if job.request.messages is not None:
            path = "/v1/chat/completions"
            body = {
                **common_fields(s),
                **structured_fields(job.request),
                "messages": [m.model_dump() for m in job.request.messages],
                "max_tokens": s.max_tokens,
                "stream_options": {"include_usage": True},
            }
            reader = ChatChunkReader(job.job_id, job.request.top_logprobs)
        else:
            assert job.request.prompt is not None
            path = "/completion"
            body = {**completion_body(job.request.prompt, s), **structured_fields(job.request)}
            if job.request.logprobs:  # /completion names it n_probs; at least 1 to get any
                body["n_probs"] = max(1, job.request.top_logprobs or 0)
            reader = CompletionChunkReader(job.job_id, job.request.top_logprobs)
        with connect_sse(self.client, "POST", path, json=body) as source:
            job.response = source.response
            self._check_status(source.response)
            for sse in source.iter_sse():
                if sse.data == "[DONE]":
                    break
                chunk = json.loads(sse.data)
                if "error" in chunk:  # an error after the stream started (OAI-style, status stays 200)
                    raise self._chunk_failure(chunk["error"])
                yield from reader.feed(chunk)
                if reader.done is not None:
                    break
        if reader.done is None:
            reader.finish()
        if reader.done is not None:
            yield reader.done

    def _chunk_failure(self, error: object) -> StreamFailure:
        if isinstance(error, dict):
            code = error.get("code")
            return self._status_failure(code if isinstance(code, int) else 500, str(error.get("message")))
        return StreamFailure(f"{self.what} failed mid-stream: {error}", retryable=True)


def common_fields(s: Sampling) -> dict[str, Any]:
    return {**sampler_fields(s), "seed": -1 if s.seed is None else s.seed, "stop": s.stop,
            "stream": True, "cache_prompt": True}


def structured_fields(request: GenerateRequest) -> dict[str, Any]:
    """Structured output and logprobs, in the names both llama-server endpoints read (the
    chat endpoint turns logprobs/top_logprobs into n_probs itself)."""
    out: dict[str, Any] = {}
    if request.format is not None:  # "json": any JSON object, as llama-server's json_object
        out["json_schema"] = {"type": "object"} if request.format == "json" else request.format
    if request.logprobs:
        out["logprobs"] = True
        out["top_logprobs"] = max(1, request.top_logprobs or 0)
    return out


def completion_body(prompt: str, s: Sampling) -> dict[str, Any]:
    """The streaming `/completion` request this backend sends for a prompt job (`fleet bench` sends
    the very same to llama-server directly)."""
    return {**common_fields(s), "prompt": prompt, "n_predict": s.max_tokens}


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
                extra={
                    "timings": chunk.get("timings", {}),
                    "stop_type": stop_type,
                    "stopping_word": chunk.get("stopping_word", ""),
                    "tokens_cached": chunk.get("tokens_cached", 0),
                    **self.logprobs.extra(),
                },
            )

    def finish(self) -> None:
        """The stream ended without a `stop: true` chunk: it was cut (leaves `done` unset)."""


class ChatChunkReader:
    """Reads `/v1/chat/completions` chunks: deltas, a chunk with finish_reason, then a usage chunk."""

    def __init__(self, job_id: str, top_logprobs: int | None = None) -> None:
        self.job_id = job_id
        self.done: Done | None = None
        self.logprobs = LogprobsCollector(top_logprobs)
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] = {}
        self.timings: dict[str, Any] = {}

    def feed(self, chunk: dict[str, Any]) -> Iterator[Event]:
        for choice in chunk.get("choices") or []:
            self.logprobs.add((choice.get("logprobs") or {}).get("content"))
            text = (choice.get("delta") or {}).get("content")
            if text:
                yield Token(self.job_id, text)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if chunk.get("timings"):
            self.timings = chunk["timings"]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
            self.finish()

    def finish(self) -> None:
        """At [DONE] or the usage chunk; without a finish_reason the stream was cut."""
        if self.finish_reason is None:
            return
        self.done = Done(
            self.job_id,
            "length" if self.finish_reason == "length" else "stop",
            prompt_tokens=int(self.usage.get("prompt_tokens") or 0),
            completion_tokens=int(self.usage.get("completion_tokens") or 0),
            extra={"timings": self.timings, "server_finish_reason": self.finish_reason,
                   **self.logprobs.extra()},
        )
