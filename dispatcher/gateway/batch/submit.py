"""Submitting a batch: check every line, create the batch record, enqueue the lines in chunks.

Idempotent: each chunk is one MULTI that enqueues the chunk's missing lines and marks them `q`
in the batch's lines hash (dispatcher/gateway/batch/record.py). Running the same submission again after a
crash or Ctrl-C asks the hash which keys it already has and enqueues only the others, so no
line runs twice, whether its job is still in Redis or already finished and expired. One
submitter at a time holds the batch's lock.

The submission is one plan (dispatcher/plans.py): `submit_batch` runs it on a sync client (the
CLI), the gateway on its async one (`submit_plan`).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from redis import Redis

from backends.contract.batch.line_record import BATCH_ID_PATTERN, line_job_id
from backends.contract.connect import server_version
from backends.contract.keys import batch_key, batch_lines_key, batch_lock_key, queue_name
from backends.contract.lua import RELEASE_LOCK, lua_script
from backends.contract.replies import as_str
from dispatcher.gateway.batch import record
from dispatcher.gateway.batch.lines import BatchLine, Scan, scan, valid_lines
from dispatcher.plans import Call, Eval, Guarded, Plan, ask, cmd, run
from dispatcher.rules import PreparedJob, prepare, wake_plan

CHUNK = 500  # lines per MULTI
LOCK_MS = 20_000
DEFAULT_RETENTION = 7 * 86400  # results kept after the batch ends (and after its window)
BATCH_JOB_RESULT_TTL = 600  # a line's own RQ result: the batch record keeps the result longer
MAX_WINDOW = 30 * 86400  # bounds keep every TTL (window + retention) well inside Redis' range
MAX_RETENTION = 365 * 86400

# KEYS, ARGV and replies: the script's header.
_REFRESH = lua_script("dispatcher.gateway.batch", "refresh_lock.lua")  # only while we own the lock


class BatchRefused(Exception):
    """The batch cannot be submitted (bad lines, another input under this id, a busy lock)."""

    def __init__(self, message: str, scan: Scan | None = None) -> None:
        super().__init__(message)
        self.scan = scan


class BatchQueueFull(BatchRefused):
    """The pool's open batches already hold so many lines that this batch would pass the cap."""

    def __init__(self, open_lines: int, lines: int, spec: BatchSpec) -> None:
        super().__init__(f"pool '{spec.pool}' has {open_lines} batch lines not ended yet; this batch's "
                         f"{lines} more would pass the limit of {spec.max_open_lines}; retry later or "
                         f"submit fewer lines")
        self.open_lines = open_lines


class TenantBatchQuotaFull(BatchRefused):
    """The tenant's open batches already hold so many lines that this batch would pass its
    `max_batch_lines` (docs/tenants.md: a batch's own quota)."""

    def __init__(self, open_lines: int, lines: int, spec: BatchSpec) -> None:
        cap = spec.tenant_max_open_lines or 0
        why = ("it may not run batches (max_batch_lines 0)" if cap == 0 else
               f"it has {open_lines} batch lines not ended yet; this batch's {lines} more would pass its "
               f"max_batch_lines of {cap}")
        super().__init__(f"tenant '{spec.tenant}': {why}")
        self.open_lines, self.lines, self.never = open_lines, lines, lines > cap


@dataclass
class BatchSpec:
    batch_id: str
    pool: str
    priority: str = "low"
    window: int = 86400  # seconds the lines may wait in the queue (OpenAI's completion_window)
    retention: int = DEFAULT_RETENTION
    job_timeout: int = 600
    endpoint: str = ""
    input_name: str = ""
    metadata: dict[str, str] | None = None
    extra: dict[str, str] = field(default_factory=dict)  # more state fields (the gateway's file ids)
    max_open_lines: int | None = None  # cap on the pool's batch lines not ended yet (None: no cap)
    tenant_max_open_lines: int | None = None  # the same cap on the tenant's batches (None: no cap)
    tenant: str | None = None  # whose lines: they wait in the tenant's queue and count as its usage


@dataclass
class SubmitReport:
    batch_id: str
    scan: Scan
    created: bool  # False: the batch existed (a resumed or repeated submission)
    enqueued: int  # lines this run enqueued
    state: str


def default_batch_id(fingerprint: str) -> str:
    """The same input gets the same id, so re-running a submission resumes it."""
    return "batch_" + fingerprint[:24]


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


ProgressFn = Callable[[int, int], None]


def submit_batch(redis: Redis, spec: BatchSpec, open_lines: Callable[[], Iterable[str]], *,
                 skip_invalid: bool = False, chunk: int = CHUNK, progress: ProgressFn | None = None,
                 checked: Scan | None = None) -> SubmitReport:
    """Check all lines of `open_lines()` (called twice: check, then enqueue), then enqueue the
    missing ones. Raises BatchRefused when a line is bad (unless skip_invalid) or the id is taken
    by another input. `progress(done, total)` after each chunk."""
    found = check(spec, open_lines, skip_invalid=skip_invalid, checked=checked)
    kw = redis.connection_pool.connection_kwargs
    server_version(redis, f"redis://{kw.get('host', '?')}:{kw.get('port', '?')}")  # RedisTooOld
    return run(redis, submit_plan(spec, open_lines, found, chunk=chunk, progress=progress))


def check(spec: BatchSpec, open_lines: Callable[[], Iterable[str]], *, skip_invalid: bool = False,
          checked: Scan | None = None) -> Scan:
    """The scan of the lines, or BatchRefused (a bad id, window or retention, bad lines)."""
    if not BATCH_ID_PATTERN.fullmatch(spec.batch_id):
        raise BatchRefused(f"batch id {spec.batch_id!r} must be 1-64 characters from A-Z a-z 0-9 _ -")
    if not (0 < spec.window <= MAX_WINDOW and 0 < spec.retention <= MAX_RETENTION):
        raise BatchRefused(f"the completion window must be 1 s to {MAX_WINDOW // 86400} days and the "
                           f"retention 1 s to {MAX_RETENTION // 86400} days")
    found = checked or scan(open_lines())
    if found.invalid and not skip_invalid:
        raise BatchRefused(f"{found.invalid} bad line(s); nothing was enqueued", found)
    if not found.valid:
        raise BatchRefused("no valid line to run", found)
    return found


def submit_plan(spec: BatchSpec, open_lines: Callable[[], Iterable[str]], found: Scan, *,
                chunk: int = CHUNK, progress: ProgressFn | None = None) -> Plan[SubmitReport]:
    """Create the record, then (holding the batch's lock) enqueue the lines `found` checked."""
    now = time.time()
    deadline = int(now) + spec.window + spec.retention
    created = yield from _create_plan(spec, found, now, deadline)
    token = secrets.token_hex(8)
    lock = batch_lock_key(spec.batch_id)
    if not (yield from ask(cmd("set", lock, token, nx=True, px=LOCK_MS))):
        raise BatchRefused(f"batch {spec.batch_id} is being submitted by another process; try again "
                           f"in {LOCK_MS // 1000}s if that one died")
    release = Eval(RELEASE_LOCK, [lock], [token])
    try:
        enqueued = 0
        state = as_str((yield from ask(cmd("hget", batch_key(spec.batch_id), "state")))) or "?"
        if state == "validating":
            enqueued = yield from _enqueue(spec, open_lines, chunk, deadline, found.valid, progress, token)
            state = yield from record.start_plan(spec.batch_id, time.time())
    except GeneratorExit:
        raise  # the driver went away: nothing can be sent now (the lock expires by itself)
    except BaseException:
        yield from ask(release)
        raise
    yield from ask(release)
    return SubmitReport(spec.batch_id, found, created, enqueued, state)


def _create(redis: Redis, spec: BatchSpec, found: Scan, now: float, deadline: int) -> bool:
    return run(redis, _create_plan(spec, found, now, deadline))


def _create_plan(spec: BatchSpec, found: Scan, now: float, deadline: int) -> Plan[bool]:
    fields: dict[str, Any] = {
        "state": "validating", "pool": spec.pool, "priority": spec.priority, "window": spec.window,
        "retention": spec.retention, "endpoint": spec.endpoint, "input": spec.input_name,
        "model": next(iter(found.models)), "total": found.valid, "invalid": found.invalid, "enqueued": 0,
        "completed": 0, "failed": 0, "cancelled": 0, "prompt_tokens": 0, "completion_tokens": 0,
        "created_at": int(now), "expires_at": int(now) + spec.window,
        "metadata": json.dumps(spec.metadata or {}), **spec.extra,
    }
    cap = -1 if spec.max_open_lines is None else spec.max_open_lines
    tenant_cap = -1 if spec.tenant_max_open_lines is None else spec.tenant_max_open_lines
    reply = yield from record.create_plan(spec.batch_id, spec.pool, found.fingerprint, deadline, now, cap,
                                          found.valid, fields, spec.tenant, tenant_cap)
    if reply[0] == "created":
        return True
    if reply[0] == "full":
        raise BatchQueueFull(int(reply[1]), found.valid, spec)
    if reply[0] == "tenant_full":
        raise TenantBatchQuotaFull(int(reply[1]), found.valid, spec)
    if reply[1] != found.fingerprint:
        raise BatchRefused(f"batch {spec.batch_id} already exists with other lines; choose another --id")
    return False


def _enqueue(spec: BatchSpec, open_lines: Callable[[], Iterable[str]], chunk: int, deadline: int,
             total: int, progress: ProgressFn | None, token: str) -> Plan[int]:
    """Each chunk's missing lines: their jobs and their `q` marks in one MULTI that runs only
    while the batch is still validating (a cancel meanwhile stops the enqueueing)."""
    meta, lines_key = batch_key(spec.batch_id), batch_lines_key(spec.batch_id)
    lock = batch_lock_key(spec.batch_id)
    created_at = int(as_str((yield from ask(cmd("hget", meta, "created_at")))) or time.time())
    queue = queue_name(spec.pool, spec.priority)
    enqueued = seen = 0
    lines = valid_lines(open_lines())
    while batch := list(islice(lines, chunk)):
        if not (yield from ask(Eval(_REFRESH, [lock], [token, LOCK_MS]))):
            raise BatchRefused(f"lost the submit lock of batch {spec.batch_id} (another submitter?)")
        present = yield from ask(cmd("hmget", lines_key, [line.key for line in batch]))
        missing = [line for line, value in zip(batch, present, strict=True) if value is None]
        # lines may wait in the queue until the completion window ends, not longer
        queue_ttl = max(1, created_at + spec.window - int(time.time()))
        calls: list[Call] = []
        for line in missing:
            calls += _prepared(spec, line, queue_ttl).enqueue_calls(queue)
        calls += record.queued_calls(spec.batch_id, [(x.key, x.kind, x.custom_id) for x in missing], deadline)
        if (yield Guarded(meta, "state", "validating", calls)) is None:
            break  # cancelled meanwhile: enqueue nothing more
        if missing:
            yield from wake_plan(spec.pool)
        enqueued += len(missing)
        seen += len(batch)
        if progress is not None:
            progress(seen, total)
    return enqueued


def _prepared(spec: BatchSpec, line: BatchLine, queue_ttl: int) -> PreparedJob:
    named = {"tenant": spec.tenant} if spec.tenant else {}
    job = prepare(None, spec.priority, {**line.request, **named}, job_timeout=spec.job_timeout,
                  result_ttl=BATCH_JOB_RESULT_TTL, queue_ttl=queue_ttl)
    job.job_id = line_job_id(spec.batch_id, line.key)
    return job
