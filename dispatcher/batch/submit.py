"""Submitting a batch: check every line, create the batch record, enqueue the lines in chunks.

Idempotent: each chunk is one MULTI that enqueues the chunk's missing lines and marks them `q`
in the batch's lines hash (dispatcher/batch/record.py). Running the same submission again after a
crash or Ctrl-C asks the hash which keys it already has and enqueues only the others, so no
line runs twice, whether its job is still in Redis or already finished and expired. One
submitter at a time holds the batch's lock.
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
from redis.exceptions import WatchError
from rq import Queue

from backends.contract.connect import MIN_REDIS_VERSION, server_version
from backends.contract.keys import BATCHES_INDEX, batch_key, batch_lines_key, batch_lock_key, open_batches_key
from backends.contract.lua import RELEASE_LOCK, lua_script
from backends.contract.replies import as_str
from dispatcher.batch import record
from dispatcher.batch.lines import BatchLine, Scan, scan, valid_lines
from dispatcher.client import Fleet, rq_queues
from dispatcher.durability import push_wake

CHUNK = 500  # lines per MULTI
LOCK_MS = 20_000
DEFAULT_RETENTION = 7 * 86400  # results kept after the batch ends (and after its window)
BATCH_JOB_RESULT_TTL = 600  # a line's own RQ result: the batch record keeps the result longer
MAX_WINDOW = 30 * 86400  # bounds keep every TTL (window + retention) well inside Redis' range
MAX_RETENTION = 365 * 86400

# KEYS, ARGV and replies: each script's header.
_CREATE = lua_script("dispatcher.batch", "create.lua")  # the batch record, unless it exists
_REFRESH = lua_script("dispatcher.batch", "refresh_lock.lua")  # only while we own the lock


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


def submit_batch(redis: Redis, spec: BatchSpec, open_lines: Callable[[], Iterable[str]], *,
                 skip_invalid: bool = False, chunk: int = CHUNK,
                 progress: Callable[[int, int], None] | None = None,
                 checked: Scan | None = None) -> SubmitReport:
    """Check all lines of `open_lines()` (called twice: check, then enqueue), then enqueue the
    missing ones. Raises BatchRefused when a line is bad (unless skip_invalid) or the id is taken
    by another input. `progress(done, total)` after each chunk."""
    if not record.BATCH_ID_PATTERN.fullmatch(spec.batch_id):
        raise BatchRefused(f"batch id {spec.batch_id!r} must be 1-64 characters from A-Z a-z 0-9 _ -")
    if not (0 < spec.window <= MAX_WINDOW and 0 < spec.retention <= MAX_RETENTION):
        raise BatchRefused(f"the completion window must be 1 s to {MAX_WINDOW // 86400} days and the "
                           f"retention 1 s to {MAX_RETENTION // 86400} days")
    found = checked or scan(open_lines())
    if found.invalid and not skip_invalid:
        raise BatchRefused(f"{found.invalid} bad line(s); nothing was enqueued", found)
    if not found.valid:
        raise BatchRefused("no valid line to run", found)
    now = time.time()
    deadline = int(now) + spec.window + spec.retention
    created = _create(redis, spec, found, now, deadline)
    token = secrets.token_hex(8)
    if not redis.set(batch_lock_key(spec.batch_id), token, nx=True, px=LOCK_MS):
        raise BatchRefused(f"batch {spec.batch_id} is being submitted by another process; try again "
                           f"in {LOCK_MS // 1000}s if that one died")
    refresh = redis.register_script(_REFRESH)
    lock = batch_lock_key(spec.batch_id)
    enqueued = 0
    try:
        state = as_str(redis.hget(batch_key(spec.batch_id), "state")) or "?"
        if state == "validating":
            enqueued = _enqueue(redis, spec, open_lines, chunk, deadline, found.valid, progress,
                                lambda: bool(refresh(keys=[lock], args=[token, LOCK_MS])))
            state = _start(redis, spec.batch_id)
    finally:
        redis.register_script(RELEASE_LOCK)(keys=[lock], args=[token])
    return SubmitReport(spec.batch_id, found, created, enqueued, state)


def _create(redis: Redis, spec: BatchSpec, found: Scan, now: float, deadline: int) -> bool:
    fields: dict[str, Any] = {
        "state": "validating", "pool": spec.pool, "priority": spec.priority, "window": spec.window,
        "retention": spec.retention, "endpoint": spec.endpoint, "input": spec.input_name,
        "model": next(iter(found.models)), "total": found.valid, "invalid": found.invalid, "enqueued": 0,
        "completed": 0, "failed": 0, "cancelled": 0, "prompt_tokens": 0, "completion_tokens": 0,
        "created_at": int(now), "expires_at": int(now) + spec.window,
        "metadata": json.dumps(spec.metadata or {}), **spec.extra,
    }
    cap = -1 if spec.max_open_lines is None else spec.max_open_lines
    args: list[Any] = [spec.batch_id, found.fingerprint, deadline, int(now), cap, found.valid, batch_key("")]
    for name, value in fields.items():
        args += [name, value]
    reply = [as_str(x) or "" for x in redis.register_script(_CREATE)(
        keys=[batch_key(spec.batch_id), BATCHES_INDEX, open_batches_key(spec.pool)], args=args)]
    if reply[0] == "created":
        return True
    if reply[0] == "full":
        raise BatchQueueFull(int(reply[1]), found.valid, spec)
    if reply[1] != found.fingerprint:
        raise BatchRefused(f"batch {spec.batch_id} already exists with other lines; choose another --id")
    return False


def _enqueue(redis: Redis, spec: BatchSpec, open_lines: Callable[[], Iterable[str]], chunk: int,
             deadline: int, total: int, progress: Callable[[int, int], None] | None,
             still_ours: Callable[[], bool]) -> int:
    meta, lines_key = batch_key(spec.batch_id), batch_lines_key(spec.batch_id)
    created_at = int(as_str(redis.hget(meta, "created_at")) or time.time())
    fleet = Fleet(redis=redis, pool=spec.pool, result_ttl=BATCH_JOB_RESULT_TTL, job_timeout=spec.job_timeout)
    queue = _recording_queue(redis, spec)
    enqueued = seen = 0
    lines = valid_lines(open_lines())
    while batch := list(islice(lines, chunk)):
        if not still_ours():
            raise BatchRefused(f"lost the submit lock of batch {spec.batch_id} (another submitter?)")
        present = redis.hmget(lines_key, [line.key for line in batch])
        missing = [line for line, value in zip(batch, present, strict=True) if value is None]
        # lines may wait in the queue until the completion window ends, not longer
        queue_ttl = max(1, created_at + spec.window - int(time.time()))
        recorded = queue.connection.pipeline(transaction=True)
        for line in missing:
            _prepared(fleet, spec, line, queue_ttl).enqueue(queue, recorded)
            recorded.hset(lines_key, line.key, record.queued_value(line.kind, line.custom_id))
        recorded.hincrby(meta, "enqueued", len(missing))
        recorded.expireat(lines_key, deadline)
        if not _apply_while_validating(redis, meta, recorded.command_stack):
            break  # cancelled meanwhile: enqueue nothing more
        if missing:
            push_wake(redis, spec.pool)
        enqueued += len(missing)
        seen += len(batch)
        if progress is not None:
            progress(seen, total)
    return enqueued


def _recording_queue(redis: Redis, spec: BatchSpec) -> Queue:
    """The batch's RQ queue on a client that never connects (a path that cannot exist, so any
    unexpected I/O fails loudly): RQ's enqueue writes are recorded, then replayed in a MULTI that
    runs only while the batch is still validating."""
    recorder = Redis(unix_socket_path="/nonexistent/llama-fleet-rq-recorder")
    queue = rq_queues(spec.pool, recorder)[spec.priority]
    # HELLO, not INFO (@dangerous, refused to the documented ACL user); RQ only picks LPOS by it
    kw = redis.connection_pool.connection_kwargs
    where = f"redis://{kw.get('host', '?')}:{kw.get('port', '?')}"  # for the message only
    queue.redis_server_version = server_version(redis, where) or MIN_REDIS_VERSION
    return queue


def _apply_while_validating(redis: Redis, meta: str, commands: list[Any]) -> bool:
    """Run the recorded commands in one MULTI, only while the batch is `validating`: WATCH makes a
    cancel between the check and EXEC abort the MULTI (then the state is read again). Other writes
    to the state hash (a worker counting an ended line) abort it too: it is then retried."""
    while True:
        with redis.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(meta)
                if as_str(pipe.hget(meta, "state")) != "validating":
                    return False
                pipe.multi()
                for args, options in commands:
                    pipe.execute_command(*args, **options)
                pipe.execute()
                return True
            except WatchError:
                continue


def _prepared(fleet: Fleet, spec: BatchSpec, line: BatchLine, queue_ttl: int) -> Any:
    job = fleet._prepare(None, spec.priority, queue_ttl, None, dict(line.request))
    job.job_id = record.line_job_id(spec.batch_id, line.key)
    return job


def _start(redis: Redis, batch_id: str) -> str:
    """All lines enqueued: the batch is in progress (or already over, if they all ran meanwhile)."""
    script = redis.register_script(record.START)
    state = script(keys=[batch_key(batch_id), batch_lines_key(batch_id)], args=[int(time.time())])
    return as_str(state) or "?"
