"""One HTTP request of the soak, sent as a user's client sends it, and what its client was told.

A request is a `Call` (route, body, key, priority, how its answer streams, and whether the client
means to leave early). `send` runs it with httpx and returns a `Record`: status, the job ids the
gateway named (`X-Fleet-Job-Id`, or a batch's id), whether a final answer or a clear error came,
the time from send to end and the longest gap between stream chunks. `classify` turns that into
one outcome; the checks decide which outcomes are violations at which times.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx

StreamFormat = Literal["sse", "responses", "ndjson"]
Leave = Literal["after_headers", "mid_stream"]

# what the client was told, in the order classify() decides it
OUTCOMES = (
    "ok",               # 2xx with a final answer
    "refused",          # 4xx (429 included) with an error message
    "error_event",      # a stream that ended with a clear error event (a failed or timed-out job)
    "timeout_504",      # the gateway's request_timeout answered, with a message
    "redis_503",        # the documented 503 while Redis itself is unreachable
    "no_workers_503",   # 503: the gateway sees no live worker (right after a Redis restart: their
                        # status keys expired while Redis was down, until their next beat)
    "server_error",     # any other 5xx
    "left",             # the client left on purpose (a cancel: closed the connection)
    "client_timeout",   # the client gave up on purpose (its own short timeout)
    "connection_lost",  # the connection broke (allowed only while that gateway was down)
    "hung",             # the client's deadline passed without an answer
    "unclear",          # 2xx without a final answer, or an error without a message
)

TOLD = ("ok", "refused", "error_event", "timeout_504", "redis_503", "no_workers_503")


@dataclass
class Call:
    kind: str
    tenant: str
    key: str | None
    path: str
    body: Any = None  # JSON
    files: dict[str, Any] | None = None  # multipart upload
    data: dict[str, str] | None = None
    method: str = "POST"
    priority: str | None = None
    stream: StreamFormat | None = None
    leave: Leave | None = None
    client_timeout: float | None = None  # deliberate: the client gives up after this
    expect_refusal: bool = False  # bad input: must be a 4xx
    headers: dict[str, str] = field(default_factory=dict)

    def request_headers(self) -> dict[str, str]:
        out = dict(self.headers)
        if self.key is not None:
            out["Authorization"] = f"Bearer {self.key}"
        if self.priority is not None:
            out["X-Fleet-Priority"] = self.priority
        return out


@dataclass
class Record:
    id: int
    client: int
    kind: str
    tenant: str
    gateway: int
    priority: str | None
    stream: bool
    started: float  # seconds since the run's start
    ended: float = 0.0
    status: int | None = None
    job_ids: list[str] = field(default_factory=list)  # X-Fleet-Job-Id: the fleet jobs it started
    object_id: str | None = None  # the answer's own id (a file's, a batch's)
    final: bool = False  # a final answer arrived
    error_event: bool = False  # a stream's clear error event arrived
    message: str = ""  # the error's message, or what went wrong
    code: str | None = None  # an error's code
    longest_gap: float = 0.0  # seconds between two stream chunks (or send and the first)
    chunks: int = 0
    left: bool = False  # the client left on purpose
    queued_when_left: bool | None = None  # a cancel: was its job still queued when the client left
    outcome: str = ""
    expect_refusal: bool = False
    case: str | None = None  # a bad or hostile input's case (X-Soak-Case)
    exception: str | None = None
    body: dict[str, Any] | None = None  # a JSON answer, kept only where later steps need it

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    @property
    def told(self) -> bool:
        """The client was told clearly: an answer, a refusal or an error with a message."""
        return self.outcome in TOLD

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("body")
        out["told"] = self.told
        return out


def job_ids_of(response: httpx.Response) -> list[str]:
    named = response.headers.get("x-fleet-job-id", "")
    return [j for j in named.split(",") if j]


def _message(response: httpx.Response, text: str) -> tuple[str, str | None]:
    try:
        body = json.loads(text)
    except ValueError:
        return text[:300], None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or "")[:300], error.get("code")
    if isinstance(error, str):
        return error[:300], None
    return text[:300], None


class Clock:
    """Seconds since the run started (one clock for requests, faults and checks)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.wall_t0 = time.time()

    def now(self) -> float:
        return time.monotonic() - self.t0


def send(http: httpx.Client, base_url: str, call: Call, record: Record, clock: Clock, deadline: float,
         on_headers: Callable[[Record], bool] | None = None) -> Record:
    """Send `call`, fill `record` (and return it). `deadline`: seconds after which the client
    counts itself hung. `on_headers`: called once the response head arrived (a cancel asks Redis
    there whether its job is still queued); True: leave now."""
    read_timeout = call.client_timeout if call.client_timeout is not None else deadline
    timeout = httpx.Timeout(connect=10.0, read=read_timeout, write=30.0, pool=10.0)
    record.expect_refusal = call.expect_refusal
    record.case = call.headers.get("X-Soak-Case")
    try:
        request = http.build_request(call.method, base_url + call.path, json=call.body, files=call.files,
                                     data=call.data, headers=call.request_headers(), timeout=timeout)
        response = http.send(request, stream=True)
        try:
            _read(response, call, record, clock, deadline, on_headers)
        finally:
            response.close()
    except httpx.TimeoutException as e:
        if call.client_timeout is not None:
            record.left = True
            record.message = f"the client gave up after {call.client_timeout:g}s (its own timeout)"
        else:
            record.exception = f"{type(e).__name__}: {e}"
            record.message = f"no answer within the client's deadline of {deadline:g}s"
            record.outcome = "hung"
    except httpx.HTTPError as e:
        record.exception = f"{type(e).__name__}: {e}"[:300]
    record.ended = clock.now()
    record.outcome = record.outcome or classify(record, call)
    return record


def _read(response: httpx.Response, call: Call, record: Record, clock: Clock, deadline: float,
          on_headers: Callable[[Record], bool] | None) -> None:
    record.status = response.status_code
    record.job_ids = job_ids_of(response)
    last = clock.now()
    record.longest_gap = last - record.started
    if on_headers is not None and on_headers(record):
        record.left = True
        return
    if response.status_code >= 300 or call.stream is None:
        text = response.read().decode("utf-8", "replace")
        record.chunks = 1
        if response.status_code >= 300:
            record.message, record.code = _message(response, text)
        else:
            _whole(text, call, record)
        return
    for line in _lines(response):
        now = clock.now()
        record.longest_gap = max(record.longest_gap, now - last)
        last = now
        record.chunks += 1
        if now - record.started > deadline:
            record.outcome = "hung"
            record.message = f"the stream was still open after the client's deadline of {deadline:g}s"
            return
        _stream_line(line, call.stream, record)
        if record.final or record.error_event:
            return
        if call.leave == "mid_stream" and record.chunks >= 2:
            record.left = True
            return


def _lines(response: httpx.Response) -> Iterator[str]:
    for line in response.iter_lines():
        if line.strip():
            yield line


def _whole(text: str, call: Call, record: Record) -> None:
    try:
        body = json.loads(text)
    except ValueError:
        record.message = f"a 2xx whose body is not JSON: {text[:200]}"
        return
    if not isinstance(body, dict):
        record.message = "a 2xx whose body is not a JSON object"
        return
    record.body = body
    if isinstance(body.get("id"), str):
        record.object_id = body["id"]
    answers = ("choices", "data", "output", "message", "response", "embeddings", "embedding", "id", "object")
    record.final = any(k in body for k in answers) and not body.get("error")
    if not record.final:
        record.message = f"a 2xx without an answer: {text[:200]}"


def _stream_line(line: str, fmt: StreamFormat | None, record: Record) -> None:
    if fmt == "ndjson":
        try:
            obj = json.loads(line)
        except ValueError:
            return
        if isinstance(obj, dict) and obj.get("error"):
            record.error_event = True
            record.message = str(obj["error"])[:300]
        elif isinstance(obj, dict) and obj.get("done") is True:
            record.final = True
        return
    if not line.startswith("data:"):
        return  # event: lines, comments
    data = line[5:].strip()
    if data == "[DONE]":
        record.final = True
        return
    try:
        obj = json.loads(data)
    except ValueError:
        return
    if not isinstance(obj, dict):
        return
    if isinstance(obj.get("error"), dict):
        record.error_event = True
        record.message = str(obj["error"].get("message") or "")[:300]
        record.code = obj["error"].get("code")
    elif fmt == "responses":
        kind = obj.get("type")
        if kind in ("response.completed", "response.incomplete"):  # incomplete: cut at max_output_tokens
            record.final = True
        elif kind in ("error", "response.failed"):
            record.error_event = True
            record.message = str(obj.get("message") or obj.get("response", {}).get("error") or kind)[:300]
            record.code = obj.get("code")


def classify(record: Record, call: Call) -> str:
    status = record.status
    if record.left:
        return "client_timeout" if call.client_timeout is not None else "left"
    if status is None:
        return "connection_lost"
    if 200 <= status < 300:
        if record.final:
            return "ok"
        if record.error_event:
            return "error_event" if record.message else "unclear"
        return "connection_lost" if record.exception else "unclear"
    if status == 504 and record.message:
        return "timeout_504"
    if status == 503 and (record.code == "redis_unavailable" or "Redis is unreachable" in record.message):
        return "redis_503"
    if status == 503 and record.code == "no_workers":
        return "no_workers_503"
    if status >= 500:
        return "server_error"
    return "refused" if record.message else "unclear"
