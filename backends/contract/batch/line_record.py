"""A batch line's job id and the record of its ending: the part of a batch's Redis record that
workers write (the rest, and every other write, is dispatcher/gateway/batch/record.py's; docs/batch.md).

    fleet:batch:<id>        state, counts, timestamps, settings           TTL window + retention
    fleet:batch:<id>:lines  line key -> "<state><kind><custom_id JSON>[\\n<result JSON>]"   same TTL

A line key is 16 hex digits of sha256(custom_id); the line's job id is "fbatch-<id>-<key>", so a
worker (worker/hooks/batch_hook.py) finds the batch of any job it ends without reading anything else.
States: q queued, d done, f failed, x cancelled. A line ends once (record_end.lua turns `q` into
d/f/x and counts it), and the batch ends when every enqueued line has.

Results outlive the jobs (whose RQ results expire after result_ttl): the ending is copied here, in
the worker's own final MULTI, as {"t": text, "f": finish, "p": prompt tokens, "c": completion
tokens, "at": unix time[, "k": cached prompt tokens, "lp": logprobs]} or {"e": reason, "at": ...}.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from redis import Redis
from redis.client import Pipeline

from backends.contract.keys import BATCH_JOB_PREFIX, batch_key, batch_lines_key
from backends.contract.lua import lua_script, queue_script

BATCH_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # RQ job ids allow only [A-Za-z0-9_-]
KEY_CHARS = 16

# KEYS, ARGV and replies: each script's header. settle_function.lua defines the Lua `settle` (end
# the batch once every enqueued line has ended); the producers' settle.lua and start.lua call it too.
SETTLE_FUNCTION = lua_script("backends.contract.batch", "settle_function.lua")
# One line ended: queued -> d/f/x, counted, then settle.
RECORD_END = lua_script("backends.contract.batch", "settle_function.lua", "record_end.lua")


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
    if usage.get("cached_tokens"):
        out["k"] = int(usage["cached_tokens"])
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


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
