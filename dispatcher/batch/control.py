"""Reading and steering a batch: status (with the lines running now), list, cancel, and the
results in OpenAI's batch output format, streamed line by line from the batch record."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any, TextIO

from redis import Redis

from backends.contract.keys import (
    BATCH_JOB_PREFIX,
    BATCHES_INDEX,
    batch_key,
    batch_lines_key,
    cancel_key,
    inflight_key,
    job_key,
    queue_key,
    queue_names,
)
from backends.contract.replies import as_str
from dispatcher.batch import record
from dispatcher.gateway.core import JobUpdate
from dispatcher.gateway.openai_bodies import Reply

SCAN_COUNT = 1000

# KEYS: queues  ARGV: id prefix. Takes every id starting with the prefix out of the lists in one
# pass (LREM per id would be quadratic in a long queue); returns the ids taken.
_TAKE_PREFIXED = """
local taken = {}
local n = #ARGV[1]
for _, queue in ipairs(KEYS) do
  local items = redis.call('LRANGE', queue, 0, -1)
  local keep = {}
  for _, id in ipairs(items) do
    if string.sub(id, 1, n) == ARGV[1] then taken[#taken + 1] = id else keep[#keep + 1] = id end
  end
  if #keep < #items then
    redis.call('DEL', queue)
    for i = 1, #keep, 4000 do redis.call('RPUSH', queue, unpack(keep, i, math.min(i + 3999, #keep))) end
  end
end
return taken
"""
# KEYS: state  ARGV: now. validating / in_progress -> cancelling; returns the state before.
_MARK_CANCELLING = """
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'validating' or state == 'in_progress' then
  redis.call('HSET', KEYS[1], 'state', 'cancelling', 'cancelling_at', ARGV[1])
end
return state
"""
CANCELLED_RESULT = {"finish_reason": "cancelled", "text": "", "usage": {}}


def job_prefix(batch_id: str) -> str:
    return f"{BATCH_JOB_PREFIX}{batch_id}-"


def running(redis: Redis, batch_id: str) -> int:
    """Lines of the batch that workers hold right now (in-flight lists are small: one per worker)."""
    prefix = job_prefix(batch_id)
    n = 0
    for key in redis.scan_iter(inflight_key("*"), count=500):
        n += sum(1 for job_id in redis.lrange(key, 0, -1) if (as_str(job_id) or "").startswith(prefix))
    return n


def status(redis: Redis, batch_id: str, *, with_running: bool = True) -> dict[str, Any] | None:
    state = record.read_state(redis, batch_id)
    if state is not None and with_running:
        state["running"] = running(redis, batch_id) if state["state"] in record.ACTIVE_STATES else 0
    return state


def list_batches(redis: Redis, limit: int = 100) -> list[dict[str, Any]]:
    """Newest first; ids whose record expired leave the index."""
    out: list[dict[str, Any]] = []
    for raw in redis.zrevrange(BATCHES_INDEX, 0, -1):
        batch_id = as_str(raw) or ""
        state = record.read_state(redis, batch_id)
        if state is None:
            redis.zrem(BATCHES_INDEX, batch_id)
        elif len(out) < limit:
            out.append(state)
    return out


def cancel(redis: Redis, batch_id: str, job_timeout: int = 600) -> str:
    """Queued lines leave the queues at once and count as cancelled; running ones get the cancel
    signal of any fleet job (they stop at their next step and are recorded as cancelled). Returns
    the batch state after."""
    meta = batch_key(batch_id)
    before = as_str(redis.register_script(_MARK_CANCELLING)(keys=[meta], args=[int(time.time())]))
    if before is None:
        raise KeyError(batch_id)
    if before in record.FINAL_STATES:
        return before
    pool = as_str(redis.hget(meta, "pool")) or "llm"
    taken = [as_str(t) or "" for t in redis.register_script(_TAKE_PREFIXED)(
        keys=[queue_key(q) for q in queue_names(pool)], args=[job_prefix(batch_id)])]
    for start in range(0, len(taken), SCAN_COUNT):
        _end_cancelled(redis, taken[start:start + SCAN_COUNT])
    # what is still queued in the record is running (or in transit between lists): signal it
    queued = [key for key, line in _lines(redis, batch_id) if line.state == "q"]
    for start in range(0, len(queued), SCAN_COUNT):
        ids = [record.line_job_id(batch_id, key) for key in queued[start:start + SCAN_COUNT]]
        with redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.exists(job_key(job_id))
            exist = pipe.execute()
        with redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.set(cancel_key(job_id), 1, ex=job_timeout + 60)
            pipe.execute()
        _end_cancelled(redis, [j for j, e in zip(ids, exist, strict=True) if not e])  # job gone
    record.settle(redis, batch_id, time.time())
    return as_str(redis.hget(meta, "state")) or "?"


def _end_cancelled(redis: Redis, job_ids: list[str]) -> None:
    """Lines that will never run: recorded as cancelled; their RQ jobs are deleted (the batch
    record is what anyone reads about them)."""
    now = time.time()
    with redis.pipeline(transaction=True) as pipe:
        for job_id in job_ids:
            pipe.delete(job_key(job_id))
            record.record_end(pipe, job_id, CANCELLED_RESULT, None, now)
        pipe.execute()


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
