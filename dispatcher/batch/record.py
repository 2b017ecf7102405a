"""A batch in Redis: one state hash and one compact hash of its lines (docs/batch.md).

    fleet:batch:<id>        state, counts, timestamps, settings           TTL window + retention
    fleet:batch:<id>:lines  line key -> "<state><kind><custom_id JSON>[\\n<result JSON>]"   same TTL

A line key is 16 hex digits of sha256(custom_id); the line's job id is "fbatch-<id>-<key>", so a
worker (worker/batch_hook.py) finds the batch of any job it ends without reading anything else.
States: q queued, d done, f failed, x cancelled. A line enters the hash as `q` in the same MULTI
that enqueues its job, so the hash is the record of what was enqueued: a resubmission enqueues only
keys it lacks, whether the job is still in Redis or long expired. A line ends once (record_end.lua
turns `q` into d/f/x and counts it), and the batch ends when every enqueued line has.

Results outlive the jobs (whose RQ results expire after result_ttl): the ending is copied here, in
the worker's own final MULTI, as {"t": text, "f": finish, "p": prompt tokens, "c": completion
tokens, "at": unix time[, "lp": logprobs]} or {"e": reason, "at": ...}.

Every write to a batch's record goes through this module, as plans (dispatcher/plans.py) that the
CLI runs on its sync client and the gateway on its async one.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from redis import Redis
from redis.client import Pipeline

from backends.contract.keys import (
    BATCH_JOB_PREFIX,
    BATCHES_INDEX,
    OWNER_FIELD,
    batch_key,
    batch_lines_key,
    cancel_key,
    inflight_key,
    job_key,
    open_batches_key,
)
from backends.contract.lua import lua_script, queue_script
from backends.contract.replies import as_str
from dispatcher.plans import Call, Eval, Plan, Round, ask, cmd, run

BATCH_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # RQ job ids allow only [A-Za-z0-9_-]
KEY_CHARS = 16
Kind = Literal["chat", "text"]
KIND_CODES: dict[Kind, str] = {"chat": "c", "text": "t"}
KIND_OF_CODE = {v: k for k, v in KIND_CODES.items()}
COUNTERS = {"d": "completed", "f": "failed", "x": "cancelled"}
ACTIVE_STATES = ("validating", "in_progress", "cancelling")
FINAL_STATES = ("completed", "cancelled", "failed", "expired")

# KEYS, ARGV and replies: each script's header. settle_function.lua defines the Lua `settle`
# (end the batch once every enqueued line has ended) that the others call.
SETTLE = lua_script("dispatcher.batch", "settle_function.lua", "settle.lua")
# Every line is enqueued: validating -> in_progress (unless cancelled meanwhile), then settle.
START = lua_script("dispatcher.batch", "settle_function.lua", "start.lua")
# One line ended: queued -> d/f/x, counted, then settle.
RECORD_END = lua_script("dispatcher.batch", "settle_function.lua", "record_end.lua")
CREATE = lua_script("dispatcher.batch", "create.lua")  # the batch record, unless it exists
MARK_CANCELLING = lua_script("dispatcher.batch", "mark_cancelling.lua")  # -> cancelling
CANCEL_LINES = lua_script("dispatcher.batch", "cancel_lines.lua")  # one chunk of queued lines




def line_key(custom_id: str) -> str:
    return hashlib.sha256(custom_id.encode()).hexdigest()[:KEY_CHARS]


def line_job_id(batch_id: str, key: str) -> str:
    return f"{BATCH_JOB_PREFIX}{batch_id}-{key}"


def parse_job_id(job_id: str) -> tuple[str, str] | None:
    """(batch id, line key) of a batch line's job id; None for any other job."""
    if not job_id.startswith(BATCH_JOB_PREFIX) or len(job_id) < len(BATCH_JOB_PREFIX) + KEY_CHARS + 2:
        return None
    batch_id, key = job_id[len(BATCH_JOB_PREFIX):-KEY_CHARS - 1], job_id[-KEY_CHARS:]
    if job_id[-KEY_CHARS - 1] != "-" or not BATCH_ID_PATTERN.fullmatch(batch_id):
        return None
    return batch_id, key


def queued_value(kind: Kind, custom_id: str) -> str:
    return "q" + KIND_CODES[kind] + json.dumps(custom_id, ensure_ascii=False)


@dataclass
class LineState:
    state: str  # q d f x
    kind: Kind
    custom_id: str
    result: dict[str, Any] | None  # the compact ending (None while queued)


def decode_line(raw: bytes | str) -> LineState:
    text = raw.decode() if isinstance(raw, bytes) else raw
    head, _, tail = text.partition("\n")
    return LineState(head[0], KIND_OF_CODE[head[1]], json.loads(head[2:]), json.loads(tail) if tail else None)


def compact_ending(result: dict[str, Any] | None, error: str | None, now: float) -> tuple[str, str, int, int]:
    """(state, result JSON, prompt tokens, completion tokens) of a job's ending, for RECORD_END."""
    at = int(now)
    if result is None:
        return "f", _dumps({"e": error or "failed", "at": at}), 0, 0
    usage = result.get("usage") or {}
    prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    if result.get("finish_reason") == "cancelled":
        return "x", _dumps({"at": at}), prompt, completion
    out: dict[str, Any] = {"t": result.get("text", ""), "f": result.get("finish_reason"), "p": prompt,
                           "c": completion, "at": at}
    if result.get("logprobs"):
        out["lp"] = result["logprobs"]
    if "tool_calls" in result:  # a tool answer: its words and calls
        out["ct"], out["tc"] = result.get("content"), result["tool_calls"]
    return "d", _dumps(out), prompt, completion


def record_end(pipe: Pipeline | Redis, job_id: str, result: dict[str, Any] | None, error: str | None,
               now: float) -> bool:
    """Queue the line's ending into `pipe` (the worker's final MULTI) when `job_id` is a batch
    line; False for any other job."""
    parsed = parse_job_id(job_id)
    if parsed is None:
        return False
    batch_id, key = parsed
    state, payload, prompt, completion = compact_ending(result, error, now)
    queue_script(pipe, RECORD_END, [batch_key(batch_id), batch_lines_key(batch_id)],
                 [key, state, payload, prompt, completion, int(now)])
    return True


def settle(redis: Redis, batch_id: str, now: float) -> Any:
    return run(redis, ask(settle_call(batch_id, now)))


def settle_call(batch_id: str, now: float) -> Eval:
    """End the batch if every enqueued line has ended."""
    return Eval(SETTLE, [batch_key(batch_id), batch_lines_key(batch_id)], [int(now)])


def create_plan(batch_id: str, pool: str, fingerprint: str, expire_at: int, now: float, cap: int,
                lines: int, fields: dict[str, Any]) -> Plan[list[str]]:
    """Create the record unless it exists (create.lua's reply, as text)."""
    args: list[Any] = [batch_id, fingerprint, expire_at, int(now), cap, lines, batch_key("")]
    for name, value in fields.items():
        args += [name, value]
    reply = yield from ask(Eval(CREATE, [batch_key(batch_id), BATCHES_INDEX, open_batches_key(pool)], args))
    return [as_str(x) or "" for x in reply]


def queued_calls(batch_id: str, lines: Iterable[tuple[str, Kind, str]], expire_at: int) -> list[Call]:
    """Lines (key, kind, custom_id) recorded as queued and counted: run them in the MULTI that
    enqueues their jobs."""
    lines_key = batch_lines_key(batch_id)
    calls: list[Call] = [cmd("hset", lines_key, key, queued_value(kind, custom_id))
                         for key, kind, custom_id in lines]
    return [*calls, cmd("hincrby", batch_key(batch_id), "enqueued", len(calls)),
            cmd("expireat", lines_key, expire_at)]


def start_plan(batch_id: str, now: float) -> Plan[str]:
    """Every line is enqueued: the batch is in progress (or already over, if they all ran)."""
    state = yield from ask(Eval(START, [batch_key(batch_id), batch_lines_key(batch_id)], [int(now)]))
    return as_str(state) or "?"


def mark_cancelling_plan(batch_id: str, now: float) -> Plan[str | None]:
    """validating / in_progress -> cancelling; the state before (None: no such batch)."""
    before = yield from ask(Eval(MARK_CANCELLING, [batch_key(batch_id)], [int(now)]))
    return as_str(before)


def cancel_lines_call(batch_id: str, keys: list[str], now: float, job_timeout: int) -> Eval:
    """Cancel these queued lines (one bounded chunk): cancel_lines.lua."""
    fixed: list[Any] = [int(now), job_timeout + 60, line_job_id(batch_id, ""), job_key(""), inflight_key(""),
                        cancel_key(""), OWNER_FIELD]
    return Eval(CANCEL_LINES, [batch_key(batch_id), batch_lines_key(batch_id)], [*fixed, *keys])


def record_failed_plan(batch_id: str, fields: dict[str, Any], retention: int, now: int) -> Plan[None]:
    """A batch refused before any line was enqueued: its record, state failed, kept `retention`."""
    key = batch_key(batch_id)
    yield Round([cmd("hset", key, mapping={"state": "failed", "failed_at": now, "created_at": now, **fields}),
                 cmd("expire", key, retention),
                 cmd("zadd", BATCHES_INDEX, {batch_id: now}),
                 cmd("expire", BATCHES_INDEX, retention, gt=True)], transaction=True)


def forget_call(batch_id: str) -> Call:
    """Drop an expired batch from the index."""
    return cmd("zrem", BATCHES_INDEX, batch_id)


INT_FIELDS = ("total", "enqueued", "completed", "failed", "cancelled", "invalid", "prompt_tokens",
              "completion_tokens", "window", "retention", "created_at", "in_progress_at", "expires_at",
              "cancelling_at", "completed_at", "cancelled_at", "failed_at")


def read_state(redis: Redis, batch_id: str) -> dict[str, Any] | None:
    return run(redis, read_state_plan(batch_id))


def read_state_plan(batch_id: str) -> Plan[dict[str, Any] | None]:
    """The batch's state hash, decoded (numbers as ints, `metadata`/`errors` as JSON); None if unknown
    or not a batch id (so no other key, like a batch's lines hash, is ever read as a batch)."""
    if not BATCH_ID_PATTERN.fullmatch(batch_id):
        return None
    raw = yield from ask(cmd("hgetall", batch_key(batch_id)))
    return decode_state(batch_id, raw)


def decode_state(batch_id: str, raw: dict[Any, Any]) -> dict[str, Any] | None:
    if not raw:
        return None
    out: dict[str, Any] = {as_str(k) or "": as_str(v) for k, v in raw.items()}
    for name in INT_FIELDS:
        out[name] = int(out[name]) if out.get(name) not in (None, "") else None
    for name in ("metadata", "errors"):
        out[name] = json.loads(out[name]) if out.get(name) else None
    out["id"] = batch_id
    return out


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
