"""Reading and steering a batch: status (with the lines running now), list, cancel, and the
results in OpenAI's batch output format, streamed line by line from the batch record. Each is a
plan (dispatcher/plans.py): the functions without `_plan` run it on a sync client (the CLI), the
gateway runs the plans on its async client."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any, TextIO

from redis import Redis

from backends.contract.batch.line_record import BATCH_ID_PATTERN, line_job_id, parse_job_id
from backends.contract.keys import BATCHES_INDEX, batch_key, batch_lines_key, inflight_key
from backends.contract.replies import as_str
from dispatcher.gateway.batch import record
from dispatcher.gateway.core import JobUpdate
from dispatcher.gateway.openai_bodies import Reply
from dispatcher.plans import Plan, ask, cmd, gather, run

SCAN_COUNT = 1000
CANCEL_CHUNK = 500  # line keys per cancel script: Redis is never held longer than this many lines


def running_plan(batch_id: str) -> Plan[int]:
    """Lines of the batch that workers hold right now (in-flight lists are small: one per worker).
    A job id names its batch exactly (parse_job_id), so batch `a` never counts lines of `a-2`."""
    n, cursor = 0, 0
    while True:
        cursor, keys = yield from ask(cmd("scan", cursor, match=inflight_key("*"), count=500))
        for key in keys:
            for job_id in (yield from ask(cmd("lrange", key, 0, -1))):
                parsed = parse_job_id(as_str(job_id) or "")
                n += parsed is not None and parsed[0] == batch_id
        if int(cursor) == 0:
            return n


def status(redis: Redis, batch_id: str, *, with_running: bool = True) -> dict[str, Any] | None:
    return run(redis, status_plan(batch_id, with_running=with_running))


def status_plan(batch_id: str, *, with_running: bool = True) -> Plan[dict[str, Any] | None]:
    state = yield from record.read_state_plan(batch_id)
    if state is not None and with_running:
        active = state["state"] in record.ACTIVE_STATES
        state["running"] = (yield from running_plan(batch_id)) if active else 0
    return state


def list_batches(redis: Redis, limit: int = 100, owner: str | None = None) -> list[dict[str, Any]]:
    return run(redis, list_plan(limit, owner))


def list_plan(limit: int = 100, owner: str | None = None) -> Plan[list[dict[str, Any]]]:
    """Newest first (only `owner`'s when given); ids whose record expired leave the index."""
    ids = [as_str(raw) or "" for raw in (yield from ask(cmd("zrevrange", BATCHES_INDEX, 0, -1)))]
    readable = [i for i in ids if BATCH_ID_PATTERN.fullmatch(i)]  # no other key is read
    raws = dict(zip(readable, (yield from gather([cmd("hgetall", batch_key(i)) for i in readable])),
                    strict=True))
    out: list[dict[str, Any]] = []
    gone = []
    for batch_id in ids:
        state = record.decode_state(batch_id, raws.get(batch_id) or {})
        if state is None:
            gone.append(record.forget_call(batch_id))
        elif len(out) < limit and (owner is None or state.get("owner") == owner):
            out.append(state)
    yield from gather(gone)
    return out


def cancel(redis: Redis, batch_id: str, job_timeout: int = 600, chunk: int = CANCEL_CHUNK) -> str:
    return run(redis, cancel_plan(batch_id, job_timeout, chunk))


def cancel_plan(batch_id: str, job_timeout: int = 600, chunk: int = CANCEL_CHUNK) -> Plan[str]:
    """Queued lines count as cancelled at once (their queue entries stay behind as tombstones the
    claim script drops); running ones get the cancel signal of any fleet job (they stop at their
    next step and are recorded as cancelled). Only this batch's own lines are touched, read from
    its lines hash in chunks of `chunk`, so no queue is scanned. Returns the batch state after;
    KeyError for an unknown batch."""
    if not BATCH_ID_PATTERN.fullmatch(batch_id):
        raise KeyError(batch_id)
    before = yield from record.mark_cancelling_plan(batch_id, time.time())
    if before is None:
        raise KeyError(batch_id)
    if before in record.FINAL_STATES:
        return before
    cursor = 0
    while True:
        cursor, fields = yield from ask(cmd("hscan", batch_lines_key(batch_id), cursor, count=chunk))
        queued = [as_str(k) or "" for k, v in fields.items() if (as_str(v) or "")[:1] == "q"]
        for start in range(0, len(queued), chunk):  # HSCAN's count is a hint
            yield from ask(record.cancel_lines_call(batch_id, queued[start:start + chunk], time.time(),
                                                    job_timeout))
        if int(cursor) == 0:
            break
    yield from ask(record.settle_call(batch_id, time.time()))
    return as_str((yield from ask(cmd("hget", batch_key(batch_id), "state")))) or "?"


class ResultPages:
    """A batch's ended lines as OpenAI batch output objects, read from its lines hash a page
    (HSCAN) at a time: `page_plan()` until `done`. Every line comes once (HSCAN may repeat a field
    while the hash grows or rehashes); queued lines are left out."""

    def __init__(self, batch_id: str, model: str = "") -> None:
        self.batch_id = batch_id
        self.model = model
        self.cursor = 0
        self.done = False
        self._seen: set[str] = set()

    def page_plan(self) -> Plan[list[tuple[bool, dict[str, Any]]]]:
        """The next page: (is_error, output object) per line."""
        key = batch_lines_key(self.batch_id)
        cursor, fields = yield from ask(cmd("hscan", key, self.cursor, count=SCAN_COUNT))
        self.cursor, self.done = int(cursor), int(cursor) == 0
        out = []
        for raw_key, value in fields.items():
            line_key = as_str(raw_key) or ""
            if line_key in self._seen:
                continue
            self._seen.add(line_key)
            line = record.decode_line(value)
            if line.state != "q":
                out.append((line.state != "d", output_object(self.batch_id, line_key, line, self.model)))
        return out


def result_lines(redis: Redis, batch_id: str, model: str) -> Iterator[tuple[bool, dict[str, Any]]]:
    """(is_error, OpenAI batch output object) per ended line, in the record's order."""
    pages = ResultPages(batch_id, model)
    while not pages.done:
        yield from run(redis, pages.page_plan())


def output_object(batch_id: str, key: str, line: record.LineState, model: str) -> dict[str, Any]:
    """One line of OpenAI's batch output (or error) file."""
    out: dict[str, Any] = {"id": f"batch_req_{key}", "custom_id": line.custom_id, "response": None,
                           "error": None}
    r = line.result or {}
    if line.state == "d":
        result = {"text": r.get("t", ""), "finish_reason": r.get("f"), "logprobs": r.get("lp"),
                  "usage": {"prompt_tokens": r.get("p", 0), "completion_tokens": r.get("c", 0),
                            "cached_tokens": r.get("k", 0)}}
        if "tc" in r:
            result.update(content=r.get("ct"), tool_calls=r["tc"])
        job_id = line_job_id(batch_id, key)
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
