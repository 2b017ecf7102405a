"""Closed-loop load for `fleet bench`: C users, each sending its next request as soon as the last
one ended, against one target. `--via api`: the fleet (Fleet.submit + the job's stream) or a
llama-server directly (`/completion` SSE, the very body the llama-server backend sends).
`--via http`: OpenAI's `/v1/completions` SSE, the same client and body for `fleet serve` and for
llama-server (`CompletionsTarget`).

Every time is taken client-side: TTFT from just before submit/POST to the first text delta,
end-to-end to the final event. Tokens are the completion tokens the system reports.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from httpx_sse import connect_sse

from backends.contract.connect import redis_from_url
from backends.contract.schema import GenerateRequest, Sampling, SamplingDefaults
from backends.llama_server import common_fields, completion_body
from dispatcher.client import Fleet
from ecosystem.local.bench_workloads import BenchRequest

REQUEST_TIMEOUT = 600.0
POOL = "llm"  # the fleet's default pool: the model name its gateway serves
# what the native path sends llama-server beyond OpenAI's fields (its sampler defaults, which are
# the fleet's, spelled out; prompt caching, llama-server's default): sent to llama-server only, as
# the gateway refuses fields it does not know
LLAMA_SERVER_FIELDS = ("top_k", "min_p", "repeat_penalty", "cache_prompt")


@dataclass
class Sample:
    ttft: float | None  # seconds, submit -> first text
    e2e: float  # seconds, submit -> end
    tokens: int  # completion tokens
    error: str | None = None


class Target(Protocol):
    def request(self, prompt: str, max_tokens: int) -> Sample: ...


def greedy(prompt: str, max_tokens: int) -> GenerateRequest:
    """Temperature 0: both systems decode the same tokens for the same prompt."""
    return GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=0.0)


class FleetTarget:
    """Jobs through Redis: submit, then read the job's stream once (text deltas, then done/error)."""

    def __init__(self, redis_url: str, pool: str = "llm") -> None:
        self.fleet = Fleet(redis=redis_from_url(redis_url), pool=pool)

    def request(self, prompt: str, max_tokens: int) -> Sample:
        req = greedy(prompt, max_tokens)
        t0 = time.perf_counter()
        job = self.fleet.submit(prompt=req.prompt, max_tokens=req.max_tokens, temperature=req.temperature)
        ttft = None
        for ev in job.events(timeout=REQUEST_TIMEOUT):
            if ev.kind == "text" and ttft is None and ev.text:
                ttft = time.perf_counter() - t0
            elif ev.kind == "done":
                tokens = int((ev.data or {}).get("usage", {}).get("completion_tokens", 0))
                return Sample(ttft, time.perf_counter() - t0, tokens)
            elif ev.kind == "error":
                return Sample(ttft, time.perf_counter() - t0, 0, str((ev.data or {}).get("error")))
        return Sample(ttft, time.perf_counter() - t0, 0, f"no result within {REQUEST_TIMEOUT:g}s")


def http_client(url: str, users: int) -> httpx.Client:
    """A kept-alive connection per user (and a few spare), long reads."""
    return httpx.Client(
        base_url=url,
        timeout=httpx.Timeout(REQUEST_TIMEOUT, connect=10),
        limits=httpx.Limits(max_connections=users + 4, max_keepalive_connections=users + 4),
    )


class LlamaServerTarget:
    """Straight to llama-server's `/completion`, one SSE stream per request."""

    def __init__(self, url: str, users: int) -> None:
        self.client = http_client(url, users)
        self.defaults = SamplingDefaults()

    def request(self, prompt: str, max_tokens: int) -> Sample:
        return again_if_stale(lambda t0: self._request(prompt, max_tokens, t0))

    def _request(self, prompt: str, max_tokens: int, t0: float) -> Sample:
        sampling: Sampling = greedy(prompt, max_tokens).sampling(self.defaults)
        return streamed(self.client, "/completion", completion_body(prompt, sampling), t0, native_chunk)

    def close(self) -> None:
        self.client.close()


class CompletionsTarget:
    """OpenAI's `/v1/completions` with `stream: true`, one SSE stream per request: the same body
    to `fleet serve` and to llama-server (plus `extra`). TTFT to the first chunk with text; tokens
    from the usage the server reports (asked for with include_usage; llama-server's last chunk
    carries it anyway)."""

    def __init__(self, url: str, users: int, *, seed: int, extra: dict[str, Any] | None = None) -> None:
        self.client = http_client(url, users)
        self.seed = seed
        self.extra = extra or {}

    @classmethod
    def llama_server(cls, url: str, users: int, *, seed: int) -> CompletionsTarget:
        return cls(url, users, seed=seed, extra=llama_server_extra())

    def body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        req = greedy(prompt, max_tokens)
        return {"model": POOL, "prompt": req.prompt, "max_tokens": req.max_tokens,
                "temperature": req.temperature, "seed": self.seed, "stream": True,
                "stream_options": {"include_usage": True}, **self.extra}

    def request(self, prompt: str, max_tokens: int) -> Sample:
        return again_if_stale(lambda t0: self._request(prompt, max_tokens, t0))

    def _request(self, prompt: str, max_tokens: int, t0: float) -> Sample:
        return streamed(self.client, "/v1/completions", self.body(prompt, max_tokens), t0, openai_chunk)

    def close(self) -> None:
        self.client.close()


def llama_server_extra() -> dict[str, Any]:
    """The fields the native path sends llama-server beyond OpenAI's, from the same source."""
    native = common_fields(greedy("the fields do not depend on it", 1).sampling(SamplingDefaults()))
    return {k: native[k] for k in LLAMA_SERVER_FIELDS}


def native_chunk(chunk: dict[str, Any]) -> tuple[bool, int | None]:
    """llama-server's `/completion` chunk: (has text, the tokens it generated when it is the last)."""
    return bool(chunk.get("content")), int(chunk.get("tokens_predicted") or 0) if chunk.get("stop") else None


def openai_chunk(chunk: dict[str, Any]) -> tuple[bool, int | None]:
    """An OpenAI completions chunk: (has text, the completion tokens of its usage). Without usage,
    llama-server's last chunk counts by its timings."""
    choices = chunk.get("choices") or []
    tokens = (chunk.get("usage") or {}).get("completion_tokens")
    if tokens is None and any(c.get("finish_reason") for c in choices):
        tokens = (chunk.get("timings") or {}).get("predicted_n")
    return any(c.get("text") for c in choices), None if tokens is None else int(tokens)


def streamed(client: httpx.Client, path: str, body: dict[str, Any], t0: float,
             read: Callable[[dict[str, Any]], tuple[bool, int | None]]) -> Sample:
    """POST `body` and read the SSE stream of JSON chunks; the request ends with the chunk that says
    how many tokens were generated (`read`). A failure before any answer on a stale connection raises
    RemoteProtocolError for `again_if_stale`; every other failure is a Sample with its error."""
    ttft, done = None, None
    try:
        with connect_sse(client, "POST", path, json=body) as source:
            if source.response.status_code != 200:
                source.response.read()
                return Sample(None, time.perf_counter() - t0, 0,
                              f"HTTP {source.response.status_code}: {source.response.text[:200]}")
            for sse in source.iter_sse():
                if sse.data == "[DONE]":
                    break
                chunk = json.loads(sse.data)
                if chunk.get("error"):  # an error after the stream began, e.g. context exceeded
                    return Sample(ttft, time.perf_counter() - t0, 0, json.dumps(chunk["error"])[:300])
                text, tokens = read(chunk)
                if text and ttft is None:
                    ttft = time.perf_counter() - t0
                if tokens is not None and done is None:  # the end; the rest is read to keep the connection
                    done = Sample(ttft, time.perf_counter() - t0, tokens)
            if done is not None:
                return done
    except httpx.RemoteProtocolError:
        if done is not None:
            return done
        if ttft is None:
            raise  # nothing came back: again_if_stale sends it once more
        return Sample(ttft, time.perf_counter() - t0, 0, "the server closed the stream")
    except httpx.HTTPError as e:
        return done or Sample(ttft, time.perf_counter() - t0, 0, f"{type(e).__name__}: {e}")
    return Sample(ttft, time.perf_counter() - t0, 0, "the stream ended without saying how many tokens")


def again_if_stale(send: Callable[[float], Sample]) -> Sample:
    """`send(t0)` once more, on the same clock, if it failed before any answer on a kept-alive
    connection the server had closed meanwhile (llama-server drops idle ones): the request never
    reached the server, so it is not an error of the system measured. A second failure counts."""
    t0 = time.perf_counter()
    try:
        return send(t0)
    except httpx.RemoteProtocolError:
        try:
            return send(t0)
        except httpx.RemoteProtocolError as e:
            return Sample(None, time.perf_counter() - t0, 0, f"RemoteProtocolError: {e}")


@dataclass
class LoadResult:
    samples: list[Sample]
    wall: float  # seconds from the users' start to the last request's end


def request_for(requests: Sequence[BenchRequest], user: int, n: int, requests_per_user: int) -> BenchRequest:
    """The same user and request number get the same request on every system."""
    return requests[(user * requests_per_user + n) % len(requests)]


def closed_loop(
    target: Target,
    users: int,
    requests_per_user: int,
    requests: Sequence[BenchRequest],
    on_sample: Callable[[Sample], None] = lambda s: None,
) -> LoadResult:
    """Run `users` threads, each sending `requests_per_user` requests back to back."""
    samples: list[Sample] = []
    lock = threading.Lock()
    start = threading.Barrier(users + 1)

    def user(u: int) -> None:
        start.wait()
        for n in range(requests_per_user):
            try:
                req = request_for(requests, u, n, requests_per_user)
                s = target.request(req.prompt, req.max_tokens)
            except Exception as e:  # a broken request is a data point, not the end of the run
                s = Sample(None, 0.0, 0, f"{type(e).__name__}: {e}")
            with lock:
                samples.append(s)
            on_sample(s)

    threads = [threading.Thread(target=user, args=(u,), daemon=True, name=f"user-{u}") for u in range(users)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return LoadResult(samples, time.perf_counter() - t0)
