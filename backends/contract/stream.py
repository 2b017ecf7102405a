"""The per-job token stream's entries: a Redis Stream at fleet:stream:<job_id>.

Every entry carries the attempt number `a` (1 for the first run; a job that restarts because its
worker died or its engine failed runs again with the next number). Kinds (`k`):
    t  text delta (v = text, n = its index within the attempt: 0, 1, 2, ...)
    d  done       (v = JSON result, the same object job.result() returns)
    e  error      (v = JSON {"error": reason, ...})

Workers write entries with the encoders; producers read them with `decode` and the reader's rules
(dispatcher/stream.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from backends.contract.replies import Fields

STREAM_MAXLEN = 20_000  # approximate cap (tokens + markers) of one job's stream

# `restart` is never stored: the reader yields it when a higher attempt replaces text it yielded
Kind = Literal["text", "done", "error", "restart"]
_KINDS: dict[bytes, Kind] = {b"t": "text", b"d": "done", b"e": "error"}


@dataclass
class StreamEvent:
    kind: Kind
    attempt: int
    text: str = ""
    data: dict[str, Any] | None = None  # result (done) or error details (error)
    seq: int | None = None  # text: index of the delta within its attempt

    @property
    def final(self) -> bool:
        return self.kind in ("done", "error")


def encode_text(attempt: int, seq: int, text: str) -> Fields:
    return {"a": attempt, "k": "t", "n": seq, "v": text}


def encode_done(attempt: int, result: dict[str, Any]) -> Fields:
    return {"a": attempt, "k": "d", "v": json.dumps(result)}


def encode_error(attempt: int, error: dict[str, Any]) -> Fields:
    return {"a": attempt, "k": "e", "v": json.dumps(error)}


def decode(fields: dict[bytes, bytes]) -> StreamEvent:
    kind = _KINDS[fields[b"k"]]
    attempt = int(fields[b"a"])
    value = fields[b"v"].decode()
    if kind == "text":
        seq = int(fields[b"n"]) if b"n" in fields else None
        return StreamEvent(kind, attempt, text=value, seq=seq)
    return StreamEvent(kind, attempt, data=json.loads(value))


def delivered_text(entries: Iterable[dict[bytes, bytes]], before: int) -> str:
    """The text the latest attempt before `before` wrote, by the readers' rules (a re-sent index
    counted once): what a stream may have shown, and what a resumed attempt replays first."""
    attempt, next_seq = 0, 0
    parts: list[str] = []
    for fields in entries:
        try:
            ev = decode(fields)
        except (KeyError, ValueError, UnicodeDecodeError):
            continue  # not an entry a worker wrote
        if ev.kind != "text" or not attempt <= ev.attempt < before:
            continue
        if ev.attempt > attempt:
            attempt, next_seq, parts = ev.attempt, 0, []
        if ev.seq is not None:
            if ev.seq < next_seq:
                continue
            next_seq = ev.seq + 1
        parts.append(ev.text)
    return "".join(parts)
