"""A batch in Redis: one state hash and one compact hash of its lines (docs/batch.md). The keys,
the line value, the line job ids and the ending a worker records are the contract's
(backends/contract/batch/line_record.py), since workers write them too.

A line enters the hash as `q` in the same MULTI that enqueues its job, so the hash is the record of
what was enqueued: a resubmission enqueues only keys it lacks, whether the job is still in Redis or
long expired. A line ends once, in the worker's final MULTI (the contract's record_end), and the
batch ends when every enqueued line has.

Every other write to a batch's record goes through this module, as plans (dispatcher/plans.py)
that the CLI runs on its sync client and the gateway on its async one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from redis import Redis

from backends.contract.batch.line_record import BATCH_ID_PATTERN, SETTLE_FUNCTION, line_job_id
from backends.contract.keys import (
    BATCHES_INDEX,
    OWNER_FIELD,
    batch_key,
    batch_lines_key,
    cancel_key,
    inflight_key,
    job_key,
    open_batches_key,
    tenant_batches_key,
)
from backends.contract.lua import lua_script
from backends.contract.replies import as_str
from dispatcher.plans import Call, Eval, Plan, Round, ask, cmd, run

Kind = Literal["chat", "text"]
KIND_CODES: dict[Kind, str] = {"chat": "c", "text": "t"}
KIND_OF_CODE = {v: k for k, v in KIND_CODES.items()}
COUNTERS = {"d": "completed", "f": "failed", "x": "cancelled"}
ACTIVE_STATES = ("validating", "in_progress", "cancelling")
FINAL_STATES = ("completed", "cancelled", "failed", "expired")

# KEYS, ARGV and replies: each script's header. The contract's settle_function.lua defines the Lua
# `settle` (end the batch once every enqueued line has ended) that SETTLE and START call.
SETTLE = "\n".join((SETTLE_FUNCTION, lua_script("dispatcher.gateway.batch", "settle.lua")))
# Every line is enqueued: validating -> in_progress (unless cancelled meanwhile), then settle.
START = "\n".join((SETTLE_FUNCTION, lua_script("dispatcher.gateway.batch", "start.lua")))
CREATE = lua_script("dispatcher.gateway.batch", "create.lua")  # the batch record, unless it exists
MARK_CANCELLING = lua_script("dispatcher.gateway.batch", "mark_cancelling.lua")  # -> cancelling
CANCEL_LINES = lua_script("dispatcher.gateway.batch", "cancel_lines.lua")  # one chunk of queued lines


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


def settle(redis: Redis, batch_id: str, now: float) -> Any:
    return run(redis, ask(settle_call(batch_id, now)))


def settle_call(batch_id: str, now: float) -> Eval:
    """End the batch if every enqueued line has ended."""
    return Eval(SETTLE, [batch_key(batch_id), batch_lines_key(batch_id)], [int(now)])


def create_plan(batch_id: str, pool: str, fingerprint: str, expire_at: int, now: float, cap: int,
                lines: int, fields: dict[str, Any], tenant: str | None = None,
                tenant_cap: int = -1) -> Plan[list[str]]:
    """Create the record unless it exists (create.lua's reply, as text). `cap`, `tenant_cap`:
    the most lines not ended yet of the pool's and of the tenant's open batches (-1: no cap)."""
    args: list[Any] = [batch_id, fingerprint, expire_at, int(now), cap, lines, batch_key(""), tenant_cap]
    for name, value in fields.items():
        args += [name, value]
    keys = [batch_key(batch_id), BATCHES_INDEX, open_batches_key(pool),
            tenant_batches_key(tenant) if tenant else ""]
    reply = yield from ask(Eval(CREATE, keys, args))
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

