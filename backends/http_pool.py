"""What the HTTP backends (llama-server, Ollama) share: one streaming request per admitted job on a
thread pool, events handed to the worker through a queue, and HTTP errors turned into clear results.

A subclass says how to start a job's request and how to read its stream (`_stream`, a generator of
events); this module owns slots, threads, cancellation and the mapping of errors to job failures
(one table: `status_errors` for HTTP statuses, TRANSPORT_ERRORS for httpx's exceptions).

Like an httpx client, a backend takes an optional `transport`: tests pass `httpx.MockTransport` to
drive every error path without a server.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from backends.base import (
    BackendUnavailable,
    Done,
    Embedding,
    Event,
    Failed,
    InputRejected,
    JobRejected,
    Token,
)
from backends.contract.retry import Backoff
from backends.contract.schema import GenerateRequest, Sampling
from backends.http_settings import HttpSettings

# A stream silent for this long is treated as dead (the worker's job_timeout cancels sooner).
READ_TIMEOUT = 600.0
PROBE_TIMEOUT = 2.0
STEP_LINGER = 0.003  # seconds step() keeps gathering events after the first one

# What a job failure says and whether another engine may retry it, by HTTP status before the
# stream started (a backend adds or overrides rows). Fields: {backend} (its attributes), {what}
# (the engine and its endpoint), {status}, {message} (the server's own words).
STATUS_ERRORS: Mapping[int, tuple[str, bool]] = {
    400: ("{what} rejected the job (400): {message}", False),
    503: ("{what} is unavailable (503): {message}", True),
}
SERVER_ERROR = ("{what} failed (HTTP {status}): {message}", True)  # any other 5xx: the engine's fault
CLIENT_ERROR = ("{what} refused the job (HTTP {status}): {message}", False)  # any other status
# httpx's exceptions while a job runs, first match wins; {kind} is the exception's class name.
TRANSPORT_ERRORS: tuple[tuple[type[Exception], str, bool], ...] = (
    (httpx.TimeoutException, "{what}: timed out ({kind})", True),
    (httpx.ConnectError, "{what}: cannot connect ({error})", True),
    # includes a stream cut mid-way (RemoteProtocolError, ReadError)
    (httpx.TransportError, "{what}: connection lost mid-stream ({kind}: {error})", True),
)
# anything else is a bug or a malformed answer: say so, do not retry blindly
UNEXPECTED_ERROR = ("{what}: unexpected answer ({kind}: {error})", False)


class StreamFailure(Exception):
    """A job's request failed; `retryable` is True when the engine, not the job, is at fault."""

    def __init__(self, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable


class _BadInput(Exception):
    """The engine answered 400 to an embedding call: an input's fault, not the engine's."""


@dataclass
class StreamJob:
    job_id: str
    request: GenerateRequest
    sampling: Sampling
    cancelled: threading.Event = field(default_factory=threading.Event)
    response: httpx.Response | None = None  # the open stream, so cancel() can close it
    tokens: int = 0  # Token events produced so far


def error_message(response: httpx.Response) -> str:
    """The server's own words from an error body: llama-server's {"error": {"message": ...}},
    Ollama's {"error": "..."}, or the raw text."""
    try:
        text = response.read().decode("utf-8", "replace").strip()
    except httpx.HTTPError as e:
        return f"(unreadable error body: {e})"
    try:
        body = json.loads(text)
    except ValueError:
        return text[:500] or response.reason_phrase
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    if error:
        return str(error)
    return text[:500]


def sampler_fields(s: Sampling) -> dict[str, float | int]:
    """The sampler settings llama-server (/completion, /v1/chat) and Ollama (options) name alike."""
    return {
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "repeat_penalty": s.repeat_penalty,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
    }


def wait_until_ready(
    client: httpx.Client, path: str, timeout: float, what: str, loading_statuses: tuple[int, ...] = (503,)
) -> None:
    """GET `path` until it answers 200, retrying while the server is down or still loading
    (`loading_statuses`); BackendUnavailable after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    backoff = Backoff(0.1, 1.0)
    last = "no answer yet"
    while True:
        try:
            response = client.get(path, timeout=min(PROBE_TIMEOUT, timeout))
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code}: {error_message(response)}"
            if response.status_code not in loading_statuses:
                raise BackendUnavailable(f"{what} answered {path} with {last}")
        except httpx.TransportError as e:
            last = f"{type(e).__name__}: {e}"
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BackendUnavailable(f"{what} not ready after {timeout:g}s (last: {last})")
        time.sleep(min(backoff.next(), remaining))


class HttpStreamBackend(ABC):
    """Base of the HTTP backends: `slots` concurrent streaming requests, drained by `step()`."""

    name: str
    slots: int
    health_path: str  # GET answers 200 when the engine can take jobs
    status_errors: Mapping[int, tuple[str, bool]] = STATUS_ERRORS
    # request fields the engine has no equivalent of: a job that sets one fails at admission, named
    lacks: tuple[str, ...] = ()

    def __init__(self, settings: HttpSettings, what: str,
                 transport: httpx.BaseTransport | None = None) -> None:
        if not settings.endpoint:
            raise ValueError(f"backend type {self.name!r} needs 'endpoint' (e.g. http://127.0.0.1:8080)")
        self.settings = settings
        self.endpoint = settings.endpoint.rstrip("/")
        self.what = f"{what} at {self.endpoint}"  # names the engine in every message
        self.client = httpx.Client(
            base_url=self.endpoint,
            timeout=httpx.Timeout(READ_TIMEOUT, connect=settings.connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            transport=transport,
        )
        self.slots = 1
        self._jobs: dict[str, StreamJob] = {}
        # (job, event): step() drops events of a job that already ended (e.g. cancelled)
        self._events: queue.Queue[tuple[StreamJob, Event]] = queue.Queue()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._completed = 0
        self._failed = 0

    def _start(self) -> None:
        """Wait for the engine (bounded by connect_timeout), check it, size the pool; the subclass's
        constructor calls this last. BackendUnavailable when the engine is not there."""
        try:
            wait_until_ready(self.client, self.health_path, self.settings.connect_timeout, self.what)
            self.slots = self._discover_slots()
        except BackendUnavailable:
            self.client.close()
            raise
        # Twice the slots: a cancelled job's thread may still be waiting for its first byte (the
        # server sends headers after prefill) and must not hold up the job admitted in its place.
        self._pool = ThreadPoolExecutor(max_workers=2 * self.slots, thread_name_prefix=f"{self.name}-stream")

    def _ask(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """A short control request (not a job): health, slots, model checks."""
        return self.client.request(method, path, timeout=PROBE_TIMEOUT, **kwargs)

    # -- what a subclass provides -----------------------------------------------------------------

    @abstractmethod
    def _discover_slots(self) -> int:
        """The engine answers: check it is usable and say how many jobs it runs at once."""

    @abstractmethod
    def _stream(self, job: StreamJob) -> Iterator[Event]:
        """Run the job's request; yield its Token events and finally one Done. Raise StreamFailure
        (or let httpx errors through) on failure. Set `job.response` once the stream is open."""

    def probe(self) -> bool:
        """True when the engine answers its health check now (the fallback backend asks)."""
        try:
            return self._ask("GET", self.health_path).status_code == 200
        except httpx.HTTPError:
            return False

    def _status_failure(self, status: int, message: str) -> StreamFailure:
        """An HTTP error status before the stream started, as a job failure (`status_errors`)."""
        default = SERVER_ERROR if status >= 500 else CLIENT_ERROR
        template, retryable = self.status_errors.get(status, default)
        text = template.format(backend=self, what=self.what, status=status, message=message)
        return StreamFailure(text, retryable)

    def _exception_failure(self, error: Exception) -> tuple[str, bool]:
        """An exception raised while a job ran, as (message, retryable) (TRANSPORT_ERRORS)."""
        template, retryable = next(((t, r) for kind, t, r in TRANSPORT_ERRORS if isinstance(error, kind)),
                                   UNEXPECTED_ERROR)
        return template.format(what=self.what, kind=type(error).__name__, error=error), retryable

    # -- the Backend protocol -----------------------------------------------------------------------

    def free_slots(self) -> int:
        with self._lock:
            return self.slots - len(self._jobs)

    def admit(self, job_id: str, request: GenerateRequest) -> None:
        if self._pool is None:
            raise BackendUnavailable(f"{self.what} is closed")
        if refused := [name for name in self.lacks if getattr(request, name)]:
            raise JobRejected(f"{', '.join(refused)}: not supported by the {self.name} backend "
                              f"({self.name} has no such setting)")
        job = StreamJob(job_id, request, request.sampling(self.settings.sampling))
        with self._lock:
            if job_id in self._jobs:
                raise ValueError(f"job {job_id} is already running on {self.what}")
            if len(self._jobs) >= self.slots:
                raise RuntimeError(f"{self.what}: no free slot (admit only while free_slots() > 0)")
            self._jobs[job_id] = job
        self._pool.submit(self._run, job)

    def step(self, timeout: float) -> list[Event]:
        queued: list[tuple[StreamJob, Event]] = []
        try:
            queued.append(self._events.get(timeout=timeout) if timeout > 0 else self._events.get_nowait())
            # The server decodes all its slots in one step and sends their chunks in a burst: gather
            # the burst (a few ms) so the worker makes one Redis round trip per server step, not one
            # per token.
            linger_until = time.monotonic() + STEP_LINGER if timeout > 0 else 0.0
            while True:
                left = linger_until - time.monotonic()
                queued.append(self._events.get(timeout=left) if left > 0 else self._events.get_nowait())
        except queue.Empty:
            pass
        events: list[Event] = []
        with self._lock:  # a slot frees when the worker sees the job's final event, not before
            for job, ev in queued:
                if self._jobs.get(ev.job_id) is not job:
                    continue  # the job already ended; a late event of its thread
                events.append(ev)
                if isinstance(ev, Done | Failed):
                    del self._jobs[ev.job_id]
                    if isinstance(ev, Done):
                        self._completed += 1
                    else:
                        self._failed += 1
        return events

    def cancel(self, job_id: str) -> None:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None or job.cancelled.is_set():
            return
        job.cancelled.set()
        # The worker hears at once; the stream thread sees the flag and emits nothing more.
        self._events.put((job, Done(job_id, "cancelled", prompt_tokens=0, completion_tokens=job.tokens)))
        response = job.response
        if response is not None:
            # unblocks the reading thread and the server frees its slot; a close racing the reader
            # must not break cancel
            with contextlib.suppress(Exception):
                response.close()

    def stats(self) -> dict[str, object]:
        with self._lock:
            active = len(self._jobs)
        return {
            "backend": self.name,
            "endpoint": self.endpoint,
            "slots": self.slots,
            "active": active,
            "completed": self._completed,
            "failed": self._failed,
        }

    def close(self) -> None:
        with self._lock:
            jobs = list(self._jobs)
        for job_id in jobs:
            self.cancel(job_id)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self.client.close()

    # -- the thread that runs one job ---------------------------------------------------------------

    def _run(self, job: StreamJob) -> None:
        if job.cancelled.is_set():  # cancelled before its thread started
            return
        try:
            for ev in self._stream(job):
                if job.cancelled.is_set():
                    return
                if isinstance(ev, Token):
                    job.tokens += 1
                self._events.put((job, ev))
                if isinstance(ev, Done):
                    return
            raise StreamFailure(f"{self.what}: stream ended before the final chunk", retryable=True)
        except StreamFailure as e:
            self._fail(job, e.message, e.retryable)
        except Exception as e:
            self._fail(job, *self._exception_failure(e))
        finally:
            job.response = None

    def _fail(self, job: StreamJob, message: str, retryable: bool) -> None:
        if not job.cancelled.is_set():  # a cancelled job already got its Done
            self._events.put((job, Failed(job.job_id, message, retryable=retryable)))

    # -- embeddings (one request per call of the worker's embedding queue) ------------------------

    embed_batch = 32

    def _embed_request(self, texts: Sequence[str], truncate: Sequence[bool]) -> tuple[str, dict[str, Any]]:
        """The engine's embedding route and body for `texts`."""
        raise JobRejected(f"{self.what}: this backend does not embed")

    def _embed_answer(self, answer: Any) -> tuple[list[list[float]], int]:
        """The vectors, in input order, and the tokens the engine counted for all of them."""
        raise NotImplementedError

    def embed(self, texts: Sequence[str], truncate: Sequence[bool]) -> list[Embedding]:
        """One request for the call; a call the engine refuses as bad input (400) is asked again
        input by input, so one bad input fails only its own job. The engine counts tokens for the
        whole call: each input gets a share by its length."""
        try:
            return self._embed_call(texts, truncate)
        except _BadInput as e:
            if len(texts) == 1:
                raise InputRejected(0, str(e)) from None
        out: list[Embedding] = []
        for i, (text, cut) in enumerate(zip(texts, truncate, strict=True)):
            try:
                out += self._embed_call([text], [cut])
            except _BadInput as e:
                raise InputRejected(i, str(e)) from None
        return out

    def _embed_call(self, texts: Sequence[str], truncate: Sequence[bool]) -> list[Embedding]:
        path, body = self._embed_request(texts, truncate)
        try:
            response = self.client.post(path, json=body)
            if response.status_code == 400:
                raise _BadInput(f"{self.what} refused it (400): {error_message(response)}")
            self._check_status(response)
            vectors, tokens = self._embed_answer(response.json())
        except StreamFailure as e:
            raise (BackendUnavailable if e.retryable else JobRejected)(e.message) from None
        except httpx.HTTPError as e:
            raise BackendUnavailable(self._exception_failure(e)[0]) from None
        if len(vectors) != len(texts):
            raise JobRejected(f"{self.what}: {len(vectors)} vectors for {len(texts)} inputs")
        chars = sum(map(len, texts)) or 1
        return [Embedding(v, round(tokens * len(t) / chars)) for v, t in zip(vectors, texts, strict=True)]

    def _check_status(self, response: httpx.Response) -> None:
        if response.status_code != 200:
            raise self._status_failure(response.status_code, error_message(response))
