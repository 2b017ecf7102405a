"""The per-job token stream: a Redis Stream at fleet:stream:<job_id>.

Every entry carries the attempt number `a`. Kinds (`k`):
    t  text delta (v = text)
    d  done       (v = JSON result, the same object job.result() returns)
    e  error      (v = JSON {"error": reason, ...})
A reader that sees a higher attempt than the text it holds drops that text: a worker died and
the job restarted. A late subscriber reads from the start, so it gets every token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from redis import Redis

from dispatcher.keys import stream_key

STREAM_MAXLEN = 20_000  # approximate cap (tokens + markers) of one job's stream

Kind = Literal["text", "done", "error"]
_KINDS: dict[bytes, Kind] = {b"t": "text", b"d": "done", b"e": "error"}


@dataclass
class StreamEvent:
    kind: Kind
    attempt: int
    text: str = ""
    data: dict[str, Any] | None = None  # result (done) or error details (error)


def encode_text(attempt: int, text: str) -> dict[str, str | int]:
    return {"a": attempt, "k": "t", "v": text}


def encode_done(attempt: int, result: dict[str, Any]) -> dict[str, str | int]:
    return {"a": attempt, "k": "d", "v": json.dumps(result)}


def encode_error(attempt: int, error: dict[str, Any]) -> dict[str, str | int]:
    return {"a": attempt, "k": "e", "v": json.dumps(error)}


def decode(fields: dict[bytes, bytes]) -> StreamEvent:
    kind = _KINDS[fields[b"k"]]
    attempt = int(fields[b"a"])
    value = fields[b"v"].decode()
    if kind == "text":
        return StreamEvent(kind, attempt, text=value)
    return StreamEvent(kind, attempt, data=json.loads(value))


def read_events(redis: Redis, job_id: str, *, block_ms: int = 1000, deadline: float | None = None) -> Iterator[
    StreamEvent
]:
    """Every entry of the job's stream from the start, blocking for new ones, until done/error.

    Returns without a final event only when `deadline` (time.monotonic()) passes.
    """
    import time

    key = stream_key(job_id)
    last = "0-0"
    while True:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            block_ms = max(1, min(block_ms, int(left * 1000)))
        reply = redis.xread({key: last}, block=block_ms, count=512)
        for _key, entries in reply or []:
            for entry_id, fields in entries:
                last = entry_id
                ev = decode(fields)
                yield ev
                if ev.kind != "text":
                    return
