"""Reading and steering a batch: status (with the lines running now), list, cancel, and the
results in OpenAI's batch output format, streamed line by line from the batch record."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any, TextIO

from redis import Redis

from backends.contract.keys import (
    BATCHES_INDEX,
    OWNER_FIELD,
    batch_key,
    batch_lines_key,
    cancel_key,
    inflight_key,
    job_key,
)
from backends.contract.lua import lua_script
from backends.contract.replies import as_str
from dispatcher.batch import record
from dispatcher.gateway.core import JobUpdate
from dispatcher.gateway.openai_bodies import Reply

SCAN_COUNT = 1000
CANCEL_CHUNK = 500  # line keys per cancel script: Redis is never held longer than this many lines

# KEYS, ARGV and replies: each script's header.
_CANCEL_LINES = lua_script("dispatcher.batch", "cancel_lines.lua")  # one chunk of queued lines
_MARK_CANCELLING = lua_script("dispatcher.batch", "mark_cancelling.lua")  # -> cancelling


def running(redis: Redis, batch_id: str) -> int:
    """Lines of the batch that workers hold right now (in-flight lists are small: one per worker).
    A job id names its batch exactly (parse_job_id), so batch `a` never counts lines of `a-2`."""
    n = 0
    for key in redis.scan_iter(inflight_key("*"), count=500):
        for job_id in redis.lrange(key, 0, -1):
            parsed = record.parse_job_id(as_str(job_id) or "")
            n += parsed is not None and parsed[0] == batch_id
    return n


def status(redis: Redis, batch_id: str, *, with_running: bool = True) -> dict[str, Any] | None:
    state = record.read_state(redis, batch_id)
    if state is not None and with_running:
        state["running"] = running(redis, batch_id) if state["state"] in record.ACTIVE_STATES else 0
    return state


def list_batches(redis: Redis, limit: int = 100, owner: str | None = None) -> list[dict[str, Any]]:
    """Newest first (only `owner`'s when given); ids whose record expired leave the index."""
    out: list[dict[str, Any]] = []
    for raw in redis.zrevrange(BATCHES_INDEX, 0, -1):
        batch_id = as_str(raw) or ""
        state = record.read_state(redis, batch_id)
        if state is None:
            redis.zrem(BATCHES_INDEX, batch_id)
        elif len(out) < limit and (owner is None or state.get("owner") == owner):
            out.append(state)
    return out


def cancel(redis: Redis, batch_id: str, job_timeout: int = 600, chunk: int = CANCEL_CHUNK) -> str:
    """Queued lines count as cancelled at once (their queue entries stay behind as tombstones the
    claim script drops); running ones get the cancel signal of any fleet job (they stop at their
    next step and are recorded as cancelled). Only this batch's own lines are touched, read from
    its lines hash in chunks of `chunk`, so no queue is scanned. Returns the batch state after."""
    if not record.BATCH_ID_PATTERN.fullmatch(batch_id):
        raise KeyError(batch_id)
    meta, lines = batch_key(batch_id), batch_lines_key(batch_id)
    before = as_str(redis.register_script(_MARK_CANCELLING)(keys=[meta], args=[int(time.time())]))
    if before is None:
        raise KeyError(batch_id)
    if before in record.FINAL_STATES:
        return before
    script = redis.register_script(_CANCEL_LINES)
    fixed: list[Any] = [int(time.time()), job_timeout + 60, record.line_job_id(batch_id, ""), job_key(""),
                        inflight_key(""), cancel_key(""), OWNER_FIELD]
    cursor = 0
    while True:
        cursor, fields = redis.hscan(lines, cursor, count=chunk)
        assert isinstance(fields, dict)
        queued = [as_str(k) or "" for k, v in fields.items() if (as_str(v) or "")[:1] == "q"]
        for start in range(0, len(queued), chunk):  # HSCAN's count is a hint
            script(keys=[meta, lines], args=[*fixed, *queued[start:start + chunk]])
        if cursor == 0:
            break
    record.settle(redis, batch_id, time.time())
    return as_str(redis.hget(meta, "state")) or "?"


def _lines(redis: Redis, batch_id: str) -> Iterator[tuple[str, record.LineState]]:
    """Every line once (HSCAN may repeat a field while the hash grows or rehashes)."""
    seen: set[str] = set()
    for raw_key, value in redis.hscan_iter(batch_lines_key(batch_id), count=SCAN_COUNT):
        key = as_str(raw_key) or ""
        if key not in seen:
            seen.add(key)
            yield key, record.decode_line(value)


def result_lines(redis: Redis, batch_id: str, model: str) -> Iterator[tuple[bool, dict[str, Any]]]:
    """(is_error, OpenAI batch output object) per ended line, in the record's order; queued
    lines are left out."""
    for key, line in _lines(redis, batch_id):
        if line.state != "q":
            yield line.state != "d", output_object(batch_id, key, line, model)


def output_object(batch_id: str, key: str, line: record.LineState, model: str) -> dict[str, Any]:
    """One line of OpenAI's batch output (or error) file."""
    out: dict[str, Any] = {"id": f"batch_req_{key}", "custom_id": line.custom_id, "response": None,
                           "error": None}
    r = line.result or {}
    if line.state == "d":
        result = {"text": r.get("t", ""), "finish_reason": r.get("f"), "logprobs": r.get("lp"),
                  "usage": {"prompt_tokens": r.get("p", 0), "completion_tokens": r.get("c", 0)}}
        job_id = record.line_job_id(batch_id, key)
        reply = Reply(line.kind == "chat", model, [job_id], False, created=r.get("at"))
        out["response"] = {"status_code": 200, "request_id": f"req_{key}",
                           "body": reply.whole([JobUpdate(0, result=result)])}
    elif line.state == "x":
        out["error"] = {"code": "batch_cancelled", "message": "the batch was cancelled before the line ended"}
    else:
        reason = str(r.get("e", "failed"))
        code = "batch_expired" if reason.startswith("expired") else "job_failed"
        out["error"] = {"code": code, "message": reason}
    return out


def write_results(redis: Redis, batch_id: str, out: TextIO, errors: TextIO | None = None) -> tuple[int, int]:
    """Stream the results to `out` (errors to `errors` when given, else to `out` too); returns
    (lines written to out, lines written to errors)."""
    state = record.read_state(redis, batch_id)
    if state is None:
        raise KeyError(batch_id)
    n_out = n_err = 0
    for is_error, obj in result_lines(redis, batch_id, state.get("model") or ""):
        target = errors if (is_error and errors is not None) else out
        target.write(json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n")
        if target is out:
            n_out += 1
        else:
            n_err += 1
    return n_out, n_err
