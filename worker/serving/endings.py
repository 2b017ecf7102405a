"""Every write that starts, ends or restarts an attempt of a job, fenced by ownership.

Who holds a job is the in-flight list it is in (worker/claiming/claim.py). Every write here applies only
while the job is still in this worker's list (or, for text, while the job hash names this worker
its owner), so when the reaper took a job from a worker it thought dead (say, one cut off from
Redis for a while), nothing that worker writes about it lands: not its start, not its text, not a
second final result (docs/reliability.md, "Who holds a job"):

- the start (RQ's started status and execution, the history) — `AttemptWriter.start`;
- text deltas, numbered, so a re-send after a lost reply is recognised (`_WRITE_TEXT`);
- the one final entry with RQ's record of it, in a MULTI under WATCH (`commit_held`);
- a hand-back to the front of the queue for another attempt (`REQUEUE_LUA`), with its history line;
- the refusal of an id that is not text.

The endings themselves are built here too (`finished`, `cancelled`, `gave_up`): the loop decides
when a job ends, this module decides what its ending says.

Written here: the stream, RQ's bookkeeping (worker/serving/rqjobs.py) and the expiries. Every other
concern (a batch line's record, the observability facts) is a hook (worker/hooks/__init__.py) queued on
the same pipeline or MULTI as the write it belongs to; this module never names one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis import Redis
from redis.client import Pipeline
from redis.commands.core import Script
from redis.exceptions import ResponseError, WatchError

from backends.base import Done
from backends.contract import queue as queue_model
from backends.contract import stream, tools
from backends.contract.keys import (
    ATTEMPT_FIELD,
    FINAL_FIELD,
    OWNER_FIELD,
    SUSPECT_FIELD,
    cancel_key,
    executions_key,
    inflight_key,
    job_key,
    results_key,
    stream_key,
)
from backends.contract.lua import lua_script, queue_script
from backends.contract.replies import as_str
from backends.contract.schema import job_result
from worker.hooks import Holder, Hooks, Restart
from worker.job import ClaimedJob, Ending
from worker.serving import rqjobs

log = logging.getLogger("fleet.worker")

# Back to the front of its queue, owner cleared, the attempt's RQ execution removed, in one step:
# the queue model's requeue (backends/contract/queue).
REQUEUE_LUA = queue_model.REQUEUE

# Text deltas, written only while this worker owns the job (a worker the reaper took it from
# must not write into the next attempt's stream).
_WRITE_TEXT = lua_script("worker.serving", "write_text.lua")


class Contended(Exception):
    """The in-flight list kept changing under a final write; try again on the next flush."""


# -- what an ending says --------------------------------------------------------------------------

def result_of(job: ClaimedJob, done: Done, now: float, worker: str, backend: str) -> dict[str, Any]:
    """The result job.result() returns, as the plain dict RQ stores (schema: JobResultModel)."""
    waited = job.claimed_ms is not None and job.enqueued_ms is not None
    queue_ms = float(job.claimed_ms - job.enqueued_ms) if waited else None  # type: ignore[operator]
    ttft_ms = (job.first_token_at - job.claimed_at) * 1000 if job.first_token_at else None
    gen_s = now - job.first_token_at if job.first_token_at else 0.0
    # per-token log-probabilities, when the request asked and the engine gave them; an
    # embedding job's vectors, a text job's answer (worker/serving/text_jobs.py), a rerank job's
    # scores and tokens (worker/serving/rerank_jobs.py); the stop string that ended the text
    extra: dict[str, Any] = {k: done.extra[k] for k in ("logprobs", "embeddings", "dimensions", "answer",
                                                        "scores", "rerank", "stop_word") if done.extra.get(k)}
    text, finish = "".join(job.text), done.finish_reason
    if job.tool_answer:  # text is the raw JSON answer: its words and calls ride beside it
        answer = tools.read_answer(text, job.id)
        extra.update(content=answer.content, tool_calls=answer.tool_calls)
        if answer.reasoning:
            extra["reasoning_content"] = answer.reasoning
        if answer.tool_calls and finish == "stop":
            finish = "tool_calls"
    return job_result(
        job.id, text, finish, prompt_tokens=done.prompt_tokens,
        completion_tokens=done.completion_tokens, cached_tokens=done.cached_tokens, worker=worker,
        backend=str(done.extra.get("backend", backend)), attempt=job.attempt, queue_ms=queue_ms,
        ttft_ms=ttft_ms, total_ms=(now - job.claimed_at) * 1000,
        tokens_per_s=done.completion_tokens / gen_s if gen_s > 0 else None,
        load_ms=load_ms if isinstance(load_ms := done.extra.get("load_ms"), float) else None,
        restored=_restored(done), **extra,
    ).model_dump()


def _restored(done: Done) -> tuple[int, float] | None:
    """Prompt tokens the engine read from the host's KV store, and the read's ms (none: None)."""
    tokens, ms = done.extra.get("kv_restored_tokens"), done.extra.get("kv_restored_ms")
    return (tokens, float(ms)) if isinstance(tokens, int) and isinstance(ms, int | float) else None


def finished(job: ClaimedJob, done: Done, now: float, worker: str, backend: str) -> Ending:
    """The engine's Done: the result, or, for a job the loop cancelled at its deadline, a failure."""
    if job.timed_out:
        limit = job.deadline - job.claimed_at
        return Ending(error=f"timed out: ran longer than {limit:.0f}s (job timeout)")
    return Ending(result=result_of(job, done, now, worker, backend))


def cancelled(job: ClaimedJob, worker: str, backend: str) -> Ending:
    """Cancelled before it reached the engine: a result with finish_reason 'cancelled'."""
    return Ending(result=result_of(job, Done(job.id, "cancelled", 0, 0), time.monotonic(), worker, backend))


def gave_up(job: ClaimedJob, reason: str) -> Ending:
    """The engine failed the job on its last counted attempt (drain hand-backs are not counted)."""
    drained = f"; {job.drains} more handed back by draining workers, not counted" if job.drains else ""
    return Ending(error=f"{reason} (gave up after {job.attempt - job.drains} attempts{drained})")


def honour_rq_cancel(job: ClaimedJob, status: str | None) -> None:
    """RQ's job.cancel() on a running job: it ends cancelled, never `finished` (RQ already
    recorded it as canceled; a `finished` result would contradict RQ's own registries)."""
    ending = job.ending
    if status == "canceled" and ending is not None and ending.result is not None:
        ending.result["finish_reason"] = "cancelled"


def outcome(ending: Ending) -> str:
    """finished, cancelled or failed (the counters' and the burst summary's words)."""
    if ending.result is None:
        return "failed"
    return "cancelled" if ending.result.get("finish_reason") == "cancelled" else "finished"


# -- the writes, bound to one worker ------------------------------------------------------------

class AttemptWriter:
    """The fenced writes of one worker (`worker`, serving with `backend`), each carrying `hooks`."""

    def __init__(self, redis: Redis, worker: str, backend: str, result_ttl: int, hooks: Hooks) -> None:
        self.redis = redis
        self.worker = worker
        self.backend = backend
        self.result_ttl = result_ttl
        self.hooks = tuple(hooks)
        self.holder = Holder(worker, backend, result_ttl)
        self.inflight = inflight_key(worker)
        self.requeue_script = redis.register_script(REQUEUE_LUA)

    def start(self, job: ClaimedJob, ttl: int) -> bool:
        """RQ's started status and execution, and the history's new attempt; False if the job
        was taken over before it started here."""
        def mark_started(pipe: Pipeline, _id: str) -> None:
            rqjobs.mark_started(job, self.worker, ttl, pipe)
            for hook in self.hooks:
                hook.on_start(job, self.holder, pipe)

        return bool(commit_held(self.redis, self.inflight, [job.id], mark_started, release=False))

    def queue_text(self, jobs: Sequence[ClaimedJob], pipe: Pipeline) -> list[int]:
        """Queue every job's unsent deltas on `pipe`; pass the counts to `text_sent` once it ran."""
        return [write_text(job, pipe, self.worker, self.hooks) for job in jobs]

    @staticmethod
    def text_sent(jobs: Sequence[ClaimedJob], counts: Sequence[int]) -> None:
        for job, count in zip(jobs, counts, strict=True):
            mark_text_sent(job, count)

    def end(self, jobs: Sequence[ClaimedJob]) -> set[str]:
        """Each job's final entry and RQ's record, in one MULTI; returns the ids written (the
        others were taken over and get nothing). Raises Contended."""
        by_id = {job.id: job for job in jobs}

        def write(pipe: Pipeline, job_id: str) -> None:
            write_ending(by_id[job_id], pipe, self.holder, self.hooks)

        return commit_held(self.redis, self.inflight, list(by_id), write,
                           seen=lambda job_id, status: honour_rq_cancel(by_id[job_id], status))

    def requeue(self, job_id: str, queue: str, why: str, *, counted: bool) -> int:
        """Hand a job back to the front of its queue for its next attempt; -1 if it is no longer
        ours (the reaper already handed it back). The script also removes the attempt's RQ
        execution, so a lost reply leaves none in RQ's wip registry."""
        return requeue_and_record(self.redis, self.requeue_script, self.inflight, job_id, queue, why,
                                  self.worker, self.hooks, counted=counted)

    def put_back(self, job_id: str, queue: str) -> int:
        """A claimed job that never started goes back as it was (no new attempt)."""
        return requeue(self.requeue_script, self.inflight, job_id, queue, bump_attempt=False)

    def refuse(self, raw_id: bytes, queue: str, reason: str) -> None:
        """A claimed id that is not text: failed under its raw bytes and dropped from the list."""
        log.warning("job %r: %s", raw_id, reason)
        with self.redis.pipeline(transaction=True) as pipe:
            write_refusal(raw_id, queue, reason, self.worker, self.result_ttl, pipe)
            pipe.lrem(self.inflight, 1, raw_id)  # type: ignore[arg-type]  # raw bytes as stored
            log_refusals(pipe.execute(raise_on_error=False), f"the refusal of {raw_id!r}")


# -- the pieces (also used by the reaper for other workers' lists) ------------------------------

def requeue(script: Script, inflight: str, job_id: str, queue: str, *, bump_attempt: bool,
            died_on: str = "", counted: bool = True) -> int:
    """Move `job_id` from `inflight` back to the front of the queue it came from (its origin:
    a tenant's job to its tenant's queue; `queue` when the job hash names none); -1 if it was no
    longer there. `died_on` names a dead worker to remember in the job hash (for the final failure
    reason); `counted=False`: a drain hand-back, which does not use up one of the job's attempts."""
    keys, args = queue_model.requeue_call(inflight, job_id, bump_attempt=bump_attempt, died_on=died_on,
                                    counted=counted, fallback_queue=queue)
    return int(script(keys=keys, args=args))


def requeue_and_record(redis: Redis, script: Script, inflight: str, job_id: str, queue: str, why: str,
                       by: str, hooks: Hooks, *, counted: bool = True, died_on: str = "",
                       reaped: bool = False) -> int:
    """A requeue for another attempt, then the hooks' record of the restart (a script cannot
    carry it). Returns the new attempt count, or -1 (not in `inflight` any more: nothing recorded)."""
    attempt = requeue(script, inflight, job_id, queue, bump_attempt=True, died_on=died_on, counted=counted)
    if attempt >= 0:
        record_restart(redis, hooks, Restart(job_id, queue, attempt, why, by, reaped=reaped))
    return attempt


def record_restart(redis: Redis, hooks: Hooks, restart: Restart) -> None:
    """The hooks' record of a restart in a pipeline of its own (after a requeue script, which
    cannot carry it); sent only if a hook queued something (no hook, no round trip)."""
    if not hooks:
        return
    with redis.pipeline(transaction=False) as pipe:
        for hook in hooks:
            hook.on_restart(restart, pipe)
        if len(pipe):
            pipe.execute()


def write_text(job: ClaimedJob, pipe: Pipeline, worker: str, hooks: Hooks = ()) -> int:
    """Queue the job's unsent deltas (numbered, so a re-send after a lost reply is recognised as
    a duplicate), written only while `worker` owns the job (_WRITE_TEXT; an engine restart's new
    attempt number goes first and never lowers the stored one; `hooks` record the restart on the
    same pipeline). Returns how many; the caller marks them sent once the pipeline succeeded."""
    if not job.unsent and not job.attempt_dirty:
        return 0
    args: list[Any] = [worker, OWNER_FIELD, ATTEMPT_FIELD, job.attempt, job.sent, stream.STREAM_MAXLEN,
                       *job.unsent]
    queue_script(pipe, _WRITE_TEXT, [job_key(job.id), stream_key(job.id)], args)
    if job.suspect and job.unsent:  # text came out: its grammar compiled and was applied
        queue_script(pipe, rqjobs.CLEAR_SUSPECT, [job_key(job.id)], [SUSPECT_FIELD, worker])
    if job.attempt_dirty:
        restart = Restart(job.id, job.queue, job.attempt - 1, job.restart_reason, "engine")
        for hook in hooks:
            hook.on_restart(restart, pipe)
    return len(job.unsent)


def mark_text_sent(job: ClaimedJob, count: int) -> None:
    del job.unsent[:count]
    job.sent += count
    job.attempt_dirty = False
    if count:
        job.suspect = False


def expire_job(pipe: Pipeline, job_id: str, attempt: int, ttl: int) -> None:
    """A job's final write: everything kept about it expires with its result (nothing a job
    leaves in Redis may outlive it without a TTL)."""
    key = job_key(job_id)
    pipe.hset(key, FINAL_FIELD, attempt)
    pipe.hdel(key, SUSPECT_FIELD)
    pipe.expire(key, ttl)
    pipe.expire(results_key(job_id), ttl)
    pipe.expire(stream_key(job_id), ttl)
    pipe.expire(executions_key(job_id), ttl)
    pipe.delete(cancel_key(job_id))


def write_ending(job: ClaimedJob, pipe: Pipeline, holder: Holder, hooks: Hooks) -> None:
    """Queue the job's final entry, RQ's record of it and the expiries, then each hook's record of
    the ending (all inside the caller's MULTI, so all apply or none)."""
    ending = job.ending
    assert ending is not None
    worker, backend, result_ttl = holder.worker, holder.backend, holder.result_ttl
    if ending.result is not None:
        try:
            rqjobs.store_success(job, ending.result, worker, result_ttl, pipe)
        except Exception:  # the producer's result matters more than RQ's registries
            log.exception("job %s: RQ success bookkeeping failed; result still delivered", job.id)
            pipe.hset(job_key(job.id), "status", "finished")
        entry = stream.encode_done(job.attempt, ending.result)
    else:
        reason = ending.error or "failed"
        rqjobs.store_failure(job, reason, worker, result_ttl, pipe)
        entry = stream.encode_error(job.attempt, rqjobs.error_payload(reason, job, worker, backend))
    pipe.xadd(stream_key(job.id), entry, maxlen=stream.STREAM_MAXLEN, approximate=True)
    expire_job(pipe, job.id, job.attempt, result_ttl)
    for hook in hooks:
        hook.on_end(job, ending, holder, pipe)


def write_refusal(raw_id: bytes, queue: str, reason: str, worker: str, result_ttl: int,
                  pipe: Pipeline) -> None:
    """A claimed id that is not text (no RQ producer makes one): failed under its raw bytes."""
    printable = raw_id.decode("utf-8", "backslashreplace")
    rqjobs.store_plain_failure(job_key("").encode() + raw_id, raw_id, queue, reason, result_ttl, pipe)
    err = {"job_id": printable, "error": reason, "worker": worker, "backend": "", "attempt": 1}
    key = stream_key("").encode() + raw_id
    pipe.xadd(key, stream.encode_error(1, err))
    pipe.expire(key, result_ttl)


def commit_held(redis: Redis, inflight: str, job_ids: Sequence[str],
                write: Callable[[Pipeline, str], None], tries: int = 5, release: bool = True,
                seen: Callable[[str, str | None], None] | None = None) -> set[str]:
    """For each id still in `inflight`: queue `write(pipe, id)` (and, with `release`, drop the id
    from the list and clear its owner), all in one MULTI/EXEC that applies only if the list did
    not change meanwhile. Returns the ids written; the others were taken away (requeued by a
    reaper) and get nothing. Raises Contended if the list kept changing for `tries` rounds.
    `seen(id, status)`: the job hashes are watched too, and each one's RQ status is reported
    before its write is queued (so RQ's job.cancel() cannot slip in between)."""
    with redis.pipeline(transaction=True) as pipe:
        for _ in range(tries):
            try:
                pipe.watch(inflight)
                present = {as_str(x) for x in pipe.lrange(inflight, 0, -1)}
                mine = [j for j in dict.fromkeys(job_ids) if j in present]
                if seen is not None and mine:
                    pipe.watch(*(job_key(j) for j in mine))
                    for job_id in mine:
                        seen(job_id, as_str(_status_of(pipe, job_id)))
                pipe.multi()
                for job_id in mine:
                    write(pipe, job_id)
                    if release:
                        pipe.lrem(inflight, 1, job_id)
                        pipe.hdel(job_key(job_id), OWNER_FIELD)
                replies = pipe.execute(raise_on_error=False)
            except WatchError:
                continue
            log_refusals(replies, f"a write for {inflight}")
            return set(mine)
    raise Contended(f"{inflight} kept changing during {tries} tries")


def _status_of(pipe: Pipeline, job_id: str) -> Any:
    try:
        return pipe.hget(job_key(job_id), "status")
    except ResponseError:  # not a hash: the write records the failure plainly
        return None


def log_refusals(replies: list[Any], what: str) -> None:
    """Commands Redis refused inside an applied MULTI or pipeline (e.g. WRONGTYPE on a tampered
    key): the others applied, so these are reported, not retried."""
    for reply in replies:
        if isinstance(reply, Exception):
            log.warning("%s was partly refused by Redis: %s", what, reply)
