"""A batch in Redis: one state hash and one compact hash of its lines (docs/batch.md).

    fleet:batch:<id>        state, counts, timestamps, settings           TTL window + retention
    fleet:batch:<id>:lines  line key -> "<state><kind><custom_id JSON>[\\n<result JSON>]"   same TTL

A line key is 16 hex digits of sha256(custom_id); the line's job id is "fbatch-<id>-<key>", so a
worker (worker/batch_hook.py) finds the batch of any job it ends without reading anything else.
States: q queued, d done, f failed, x cancelled. A line enters the hash as `q` in the same MULTI
that enqueues its job, so the hash is the record of what was enqueued: a resubmission enqueues only
keys it lacks, whether the job is still in Redis or long expired. A line ends once (the Lua below
turns `q` into d/f/x and counts it), and the batch ends when every enqueued line has.

Results outlive the jobs (whose RQ results expire after result_ttl): the ending is copied here, in
the worker's own final MULTI, as {"t": text, "f": finish, "p": prompt tokens, "c": completion
tokens, "at": unix time[, "lp": logprobs]} or {"e": reason, "at": ...}.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from redis import Redis
from redis.client import Pipeline

from backends.contract.keys import BATCH_JOB_PREFIX, batch_key, batch_lines_key
from backends.contract.replies import as_str

BATCH_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # RQ job ids allow only [A-Za-z0-9_-]
KEY_CHARS = 16
Kind = Literal["chat", "text"]
KIND_CODES: dict[Kind, str] = {"chat": "c", "text": "t"}
KIND_OF_CODE = {v: k for k, v in KIND_CODES.items()}
COUNTERS = {"d": "completed", "f": "failed", "x": "cancelled"}
ACTIVE_STATES = ("validating", "in_progress", "cancelling")
FINAL_STATES = ("completed", "cancelled", "failed", "expired")

# Ends the batch when every enqueued line has ended (state in_progress -> completed, cancelling ->
# cancelled) and keeps its record for `retention` more seconds. KEYS: state, lines  ARGV: now
_SETTLE = """
local function settle(meta, lines, now)
  local m = redis.call('HMGET', meta, 'state', 'enqueued', 'completed', 'failed', 'cancelled', 'retention')
  local ended = tonumber(m[3] or '0') + tonumber(m[4] or '0') + tonumber(m[5] or '0')
  if ended < tonumber(m[2] or '0') then return 1 end
  local final
  if m[1] == 'in_progress' then final = 'completed' elseif m[1] == 'cancelling' then final = 'cancelled'
  else return 1 end
  redis.call('HSET', meta, 'state', final, final .. '_at', now)
  local ttl = tonumber(m[6] or '86400')
  redis.call('EXPIRE', meta, ttl)
  redis.call('EXPIRE', lines, ttl)
  return 2
end
"""
SETTLE = _SETTLE + "return settle(KEYS[1], KEYS[2], ARGV[1])"
# Every line is enqueued: validating -> in_progress (unless cancelled meanwhile), then settle.
# KEYS: state, lines  ARGV: now. Returns the state.
START = _SETTLE + """
if redis.call('HGET', KEYS[1], 'state') == 'validating' then
  redis.call('HSET', KEYS[1], 'state', 'in_progress', 'in_progress_at', ARGV[1])
end
settle(KEYS[1], KEYS[2], ARGV[1])
return redis.call('HGET', KEYS[1], 'state')
"""

# One line ended. KEYS: state, lines  ARGV: line key, d/f/x, result JSON, prompt tokens,
# completion tokens, now. Returns 0 if the line was not queued (unknown, already ended, or the
# batch expired: nothing is recreated without a TTL), else 1, or 2 when the batch ended with it.
RECORD_END = _SETTLE + """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local v = redis.call('HGET', KEYS[2], ARGV[1])
if not v or string.sub(v, 1, 1) ~= 'q' then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2] .. string.sub(v, 2) .. '\\n' .. ARGV[3])
local counter = 'cancelled'
if ARGV[2] == 'd' then counter = 'completed' elseif ARGV[2] == 'f' then counter = 'failed' end
redis.call('HINCRBY', KEYS[1], counter, 1)
redis.call('HINCRBY', KEYS[1], 'prompt_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'completion_tokens', ARGV[5])
return settle(KEYS[1], KEYS[2], ARGV[6])
"""


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
    script = pipe.register_script(RECORD_END)
    script(keys=[batch_key(batch_id), batch_lines_key(batch_id)],
           args=[key, state, payload, prompt, completion, int(now)], client=pipe)
    return True


def settle(redis: Redis | Pipeline, batch_id: str, now: float) -> Any:
    script = redis.register_script(SETTLE)
    return script(keys=[batch_key(batch_id), batch_lines_key(batch_id)], args=[int(now)], client=redis)


INT_FIELDS = ("total", "enqueued", "completed", "failed", "cancelled", "invalid", "prompt_tokens",
              "completion_tokens", "window", "retention", "created_at", "in_progress_at", "expires_at",
              "cancelling_at", "completed_at", "cancelled_at", "failed_at")


def read_state(redis: Redis, batch_id: str) -> dict[str, Any] | None:
    """The batch's state hash, decoded (numbers as ints, `metadata`/`errors` as JSON); None if unknown."""
    raw = redis.hgetall(batch_key(batch_id))
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
