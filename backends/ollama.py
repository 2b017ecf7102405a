"""Ollama over its HTTP API: `/api/generate` for prompts, `/api/chat` for messages, NDJSON streams.

Concurrency is the configured `parallel` (Ollama's OLLAMA_NUM_PARALLEL; default 1). Prompt jobs are
sent with `raw: true` so a prompt means the same raw completion on every backend; message jobs get
the model's template from Ollama. Errors (docs/api.md, "Errors"): a status with {"error": "..."}
before the stream starts, or an {"error": "..."} line once it has started (the status stays 200).

Thoughts: a chat without tools goes as sent (`speaks`). To a model whose /api/show lists the
"thinking" capability it carries Ollama's `think` from the job (`enable_thinking` /
`reasoning_effort` of its template kwargs, a level to gpt-oss only, a budget of 0: false;
thoughts asked apart: true); a model without it gets no `think` (Ollama refuses one). Ollama
splits its model's thoughts off itself (`message.thinking`): asked apart, they stream as the
answer JSON, as llama-server's `reasoning_content` does (backends/chat/openai_deltas.py); in a
plain text answer, back in the text between `<think>` tags, where the model wrote them; before
an answer held to JSON (a format, the generic tool format), nowhere. Ollama has no thought budget.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import httpx

from backends.base import BackendUnavailable, Done, Event, JobRejected, Token
from backends.chat.openai_deltas import DeltaAnswer
from backends.chat.reasoning import THINK
from backends.contract import tools
from backends.contract.schema import GenerateRequest
from backends.contract.text_ops import TextRequest
from backends.http_pool import STATUS_ERRORS, HttpStreamBackend, StreamFailure, StreamJob, sampler_fields
from backends.http_settings import OllamaSettings
from backends.model_card import ollama_card


class OllamaBackend(HttpStreamBackend):
    name = "ollama"
    health_path = "/api/version"
    status_errors = {
        **STATUS_ERRORS,
        # the worker's config names the model, not the job: another engine may have it
        404: ("{what} has no model {backend.model!r} (404): {message}", True),
        # Ollama's queue is full (OLLAMA_MAX_QUEUE): busy, try later or elsewhere
        503: ("{what} is busy (503): {message}", True),
    }

    lacks = ("min_tokens", "ignore_eos", "logit_bias")  # Ollama's options have none of these

    def __init__(self, settings: OllamaSettings, *, transport: httpx.BaseTransport | None = None) -> None:
        super().__init__(settings, "ollama", transport)
        self.settings: OllamaSettings = settings
        self.model = settings.model
        self._show: dict[str, Any] = {}
        self._start()

    def _discover_slots(self) -> int:
        """Fail at start, not per job, when the configured model is not pulled; Ollama does not
        tell its OLLAMA_NUM_PARALLEL, so the configured `parallel` (default 1) is the slot count."""
        try:
            response = self._ask("POST", "/api/show", json={"model": self.model})
        except httpx.HTTPError as e:
            raise BackendUnavailable(f"{self.what}: cannot ask for model {self.model!r}: {e}") from e
        if response.status_code == 404:
            raise BackendUnavailable(
                f"{self.what} has no model {self.model!r} (run `ollama pull {self.model}`)"
            )
        if response.status_code != 200:
            raise BackendUnavailable(f"{self.what}: /api/show answered HTTP {response.status_code}")
        self._show = response.json()
        return self.settings.parallel or 1

    def model_card(self) -> dict[str, object]:
        """Ollama's own /api/show of the model, as the fleet's card (backends/model_card.py)."""
        return ollama_card(self._show)

    def stats(self) -> dict[str, object]:
        return {**super().stats(), "model": self.model}

    def _embed_request(self, texts: Sequence[str], truncate: Sequence[bool]) -> tuple[str, dict[str, Any]]:
        """Ollama's /api/embed (it cuts long inputs only when every input of the call may be cut)."""
        return "/api/embed", {"model": self.model, "input": list(texts), "truncate": all(truncate)}

    def _embed_answer(self, answer: Any) -> tuple[list[list[float]], int]:
        return answer["embeddings"], int(answer.get("prompt_eval_count") or 0)

    def text_op(self, request: TextRequest) -> dict[str, object]:
        """Ollama's API has no tokenizer or template route to forward to."""
        raise JobRejected("tokenize, detokenize and apply-template are not supported by the ollama backend")

    # -- one job ------------------------------------------------------------------------------------

    def _thinks(self) -> bool:
        capabilities = self._show.get("capabilities")
        return isinstance(capabilities, list) and "thinking" in capabilities

    def _levels(self) -> bool:
        """Whether the model takes `think` as a level: gpt-oss only, in Ollama's API."""
        details = self._show.get("details")
        family = str(details.get("family") or "") if isinstance(details, dict) else ""
        return family.replace("-", "") == "gptoss"

    def speaks(self, request: GenerateRequest) -> bool:
        """A chat without tools or a format runs as sent (its thoughts as Ollama splits them);
        the rest is lowered to the generic format first."""
        return request.messages is not None and not tools.touches_tools(request) and request.format is None

    def _stream(self, job: StreamJob) -> Iterator[Event]:
        s = job.sampling
        options: dict[str, Any] = {"num_predict": s.max_tokens, **sampler_fields(s)}
        if s.seed is not None:
            options["seed"] = s.seed
        if s.stop:
            options["stop"] = s.stop
        if self.settings.n_ctx_per_seq is not None:  # else keep the loaded model's num_ctx
            options["num_ctx"] = self.settings.n_ctx_per_seq
        body: dict[str, Any] = {
            "model": self.model,
            "stream": True,
            "keep_alive": self.settings.keep_alive,
            "options": options,
        }
        if job.request.format is not None:
            body["format"] = job.request.format
        if job.request.logprobs:  # Ollama >= 0.12.11 returns them; older servers ignore the fields
            body["logprobs"] = True
            body["top_logprobs"] = job.request.top_logprobs or 0
        apart = self.speaks(job.request) and job.request.reasoning_format not in (None, "none")
        thoughts = Thoughts(job.job_id, apart, inline=job.request.format is None)
        if job.request.messages is not None:
            path = "/api/chat"
            body["messages"] = [ollama_message(m.model_dump(exclude_none=True)) for m in job.request.messages]
            if self._thinks() and (think := think_field(job.request, apart, self._levels())) is not None:
                body["think"] = think
        else:
            path = "/api/generate"
            body["prompt"] = job.request.prompt
            body["raw"] = True
        with self.client.stream("POST", path, json=body) as response:
            job.response = response
            self._check_status(response)
            for line in response.iter_lines():
                if not line.strip():
                    continue
                chunk = json.loads(line)
                if "error" in chunk:
                    raise StreamFailure(f"{self.what} failed mid-stream: {chunk['error']}", retryable=True)
                if "message" in chunk:
                    message = chunk["message"]
                    text = thoughts.feed(message.get("thinking") or "", message.get("content") or "")
                else:
                    text = chunk.get("response", "")
                if chunk.get("done"):
                    text += thoughts.close()
                if text:
                    yield Token(job.job_id, text)
                if chunk.get("done"):
                    yield final_done(job.job_id, chunk)
                    return


def think_field(request: GenerateRequest, apart: bool, levels: bool = False) -> bool | str | None:
    """Ollama's `think` for a chat to a thinking model: what the job's template kwargs say, false
    for a budget of 0, true where thoughts are asked apart (Ollama splits them off only when
    asked); a reasoning effort as the level where the model takes one (`levels`), else true;
    None: unsaid."""
    kwargs = request.chat_template_kwargs or {}
    if request.reasoning_budget == 0 or kwargs.get("enable_thinking") is False:
        return False
    effort = kwargs.get("reasoning_effort")
    if levels and effort in ("low", "medium", "high"):
        return str(effort)
    return True if apart or kwargs.get("enable_thinking") is True or effort is not None else None


def ollama_message(message: dict[str, Any]) -> dict[str, Any]:
    """A job's message as /api/chat takes it: an earlier turn's thought is `thinking`."""
    if "reasoning_content" in message:
        message["thinking"] = message.pop("reasoning_content")
    return message


class Thoughts:
    """Ollama's `thinking` and `content` deltas as the job's text: the answer JSON when thoughts
    are asked apart, else the text with its thought between `<think>` tags (`inline`), else the
    content alone (an answer held to JSON must start with it)."""

    def __init__(self, job_id: str, apart: bool, inline: bool = True) -> None:
        self._answer = DeltaAnswer(job_id, 0) if apart else None
        self._inline = inline
        self._inside = False

    def feed(self, thinking: str, content: str) -> str:
        if self._answer is not None:
            return self._answer.feed({"reasoning_content": thinking, "content": content})
        if not self._inline:
            return content
        out = ""
        if thinking and not self._inside:
            out, self._inside = THINK[0], True
        out += thinking
        if content and self._inside:
            out, self._inside = out + THINK[1], False
        return out + content

    def close(self) -> str:
        if self._answer is not None:
            return self._answer.close()
        return THINK[1] if self._inside else ""


def final_done(job_id: str, chunk: dict[str, Any]) -> Done:
    """Ollama's final object ({"done": true, "done_reason", "*_count", "*_duration"}) as a Done."""
    reason = chunk.get("done_reason") or "stop"
    timings = {
        k: chunk[k]
        for k in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")
        if k in chunk
    }
    return Done(
        job_id,
        "length" if reason == "length" else "stop",
        # Ollama leaves prompt_eval_count out when the whole prompt came from its cache
        prompt_tokens=int(chunk.get("prompt_eval_count") or 0),
        completion_tokens=int(chunk.get("eval_count") or 0),
        extra={"timings_ns": timings, "done_reason": reason},
    )
