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
from backends.contract.schema import FinishReason, Sampling
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
                "messages": [m.model_dump() for m in job.request.messages],
                "max_tokens": s.max_tokens,
                "stream_options": {"include_usage": True},
            }
            reader = ChatChunkReader(job.job_id)
        else:
            assert job.request.prompt is not None
            path = "/completion"
            body = completion_body(job.request.prompt, s)
            reader = CompletionChunkReader(job.job_id)
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


def completion_body(prompt: str, s: Sampling) -> dict[str, Any]:
    """The streaming `/completion` request this backend sends for a prompt job (`fleet bench` sends
    the very same to llama-server directly)."""
    return {**common_fields(s), "prompt": prompt, "n_predict": s.max_tokens}


class CompletionChunkReader:
    """Reads `/completion` SSE chunks: {"content", "stop": false} ... then {"stop": true, ...usage}."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.done: Done | None = None

    def feed(self, chunk: dict[str, Any]) -> Iterator[Event]:
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
                },
            )

    def finish(self) -> None:
        """The stream ended without a `stop: true` chunk: it was cut (leaves `done` unset)."""


class ChatChunkReader:
    """Reads `/v1/chat/completions` chunks: deltas, a chunk with finish_reason, then a usage chunk."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.done: Done | None = None
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] = {}
        self.timings: dict[str, Any] = {}

    def feed(self, chunk: dict[str, Any]) -> Iterator[Event]:
        for choice in chunk.get("choices") or []:
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
            extra={"timings": self.timings, "server_finish_reason": self.finish_reason},
        )
