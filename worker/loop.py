"""The worker loop: claim -> admit -> step -> stream/store, with up to `slots` jobs in flight.

    while not stopping:
        claim up to backend.free_slots() jobs     (block briefly only when nothing is in flight)
        events = backend.step()                   (one batched decode / drain of HTTP streams)
        one Redis pipeline per step: token deltas (XADD), finished jobs (RQ result + stream end),
        cancel checks for everything in flight

A heartbeat thread (worker/heartbeat.py) keeps the worker visibly alive and reaps dead workers'
jobs, independent of how long one step takes.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from redis import Redis

from backends.base import Backend, BackendUnavailable, Done, Event, Failed, JobRejected, Restarted, Token
from dispatcher import stream
from dispatcher.keys import cancel_key, queue_names, stream_key, wake_key
from worker import rqjobs
from worker.claim import Claimer
from worker.rqjobs import BadJob, ClaimedJob
from worker.settings import FleetSettings

log = logging.getLogger("fleet.worker")
IDLE_WAIT = 0.25  # seconds an idle worker blocks on the wake list before polling the queues


@dataclass
class WorkerCounters:
    """Read by the heartbeat thread for `fleet status`."""

    jobs_done: int = 0
    jobs_failed: int = 0
    tokens: int = 0
    state: str = "starting"
    recent: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) per step

    def tokens_per_second(self, window: float = 10.0) -> float:
        now = time.monotonic()
        pts = [(t, n) for t, n in self.recent if now - t <= window]
        if not pts:
            return 0.0
        span = max(now - pts[0][0], 1.0)
        return sum(n for _, n in pts) / span


class FleetWorker:
    def __init__(self, settings: FleetSettings, backend: Backend, redis: Redis, name: str) -> None:
        self.settings = settings
        self.backend = backend
        self.redis = redis
        self.name = name
        self.queues = queue_names(settings.pool)
        self.claimer = Claimer(redis, name, self.queues)
        self.inflight: dict[str, ClaimedJob] = {}
        self.counters = WorkerCounters()
        self.stopping = threading.Event()
        self._drain_deadline: float | None = None

    # -- lifecycle --------------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        # PM2 stops with SIGINT, supervisord/systemd with SIGTERM: both drain
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.stopping.is_set():  # second signal: stop now, requeue what is in flight
            self._drain_deadline = time.monotonic()
            return
        log.info("signal %s: draining %d jobs (grace %.0fs)", signum, len(self.inflight),
                 self.settings.drain_grace)
        self.stop()

    def stop(self) -> None:
        self._drain_deadline = time.monotonic() + self.settings.drain_grace
        self.stopping.set()

    def run(self) -> None:
        """Serve until stop(); then finish in-flight jobs within the grace period, requeue the rest."""
        self.counters.state = "idle"
        while not self.stopping.is_set():
            self.run_once()
        self.counters.state = "draining"
        while self.inflight and time.monotonic() < (self._drain_deadline or 0):
            self._step()
        self.requeue_all("worker stopped")
        self.counters.state = "stopped"

    def run_once(self) -> None:
        self._claim()
        if self.inflight:
            self.counters.state = "busy"
            self._step()
        else:
            self.counters.state = "idle"

    # -- claiming ---------------------------------------------------------------------------------

    def _claim(self) -> None:
        free = self.backend.free_slots()
        if free <= 0:
            return
        claimed = self.claimer.claim(free)
        if not claimed and not self.inflight:
            # idle: sleep on the wake list, then look again (plain-RQ producers never push it)
            self.redis.blpop([wake_key(self.settings.pool)], timeout=IDLE_WAIT)
            claimed = self.claimer.claim(free)
        for job_id, queue in claimed:
            try:
                self._start(job_id, queue)
            except Exception as e:  # one bad job must never take the worker down
                log.exception("job %s could not start", job_id)
                job = self.inflight.get(job_id) or ClaimedJob(job_id, queue, attempt=1)
                self._fail(job, f"internal error starting the job: {type(e).__name__}: {e}")

    def _start(self, job_id: str, queue: str) -> None:
        try:
            job = rqjobs.load(self.redis, job_id, queue, self.settings.job_timeout)
        except BadJob as e:
            self._fail(e.claimed, str(e))  # type: ignore[attr-defined]
            return
        if self.redis.exists(cancel_key(job_id)):
            self._finish_cancelled_before_start(job)
            return
        with self.redis.pipeline(transaction=True) as pipe:
            rqjobs.mark_started(job, self.name, self.settings.job_timeout + 60, pipe)
            pipe.execute()
        self.inflight[job_id] = job
        assert job.request is not None
        try:
            self.backend.admit(job_id, job.request)
        except JobRejected as e:
            self._fail(job, str(e))
        except BackendUnavailable as e:
            self._fail(job, f"backend unavailable: {e}")

    # -- one step ---------------------------------------------------------------------------------

    def _step(self) -> None:
        events = self.backend.step(0.05)
        now = time.time()
        ids = list(self.inflight)
        with self.redis.pipeline(transaction=False) as pipe:
            n_tokens = self._write_events(events, now, pipe)
            for job_id in ids:
                pipe.exists(cancel_key(job_id))
            replies = pipe.execute()
        self.counters.tokens += n_tokens
        self.counters.recent = [*self.counters.recent[-255:], (time.monotonic(), n_tokens)]
        for job_id, cancelled in zip(ids, replies[-len(ids):] if ids else [], strict=True):
            job = self.inflight.get(job_id)
            if job is None:
                continue
            if cancelled:
                self.backend.cancel(job_id)
            elif now > job.deadline and not job.timed_out:
                job.timed_out = True  # the Done(cancelled) that follows becomes a failure
                self.backend.cancel(job_id)

    def _write_events(self, events: list[Event], now: float, pipe: Any) -> int:
        n_tokens = 0
        for ev in events:
            job = self.inflight.get(ev.job_id)
            if job is None:
                continue
            if isinstance(ev, Token):
                if job.first_token_at is None:
                    job.first_token_at = now
                job.text.append(ev.text)
                job.completion_tokens += ev.n_tokens
                n_tokens += ev.n_tokens
                if ev.text:
                    pipe.xadd(stream_key(job.id), stream.encode_text(job.attempt, ev.text),
                              maxlen=stream.STREAM_MAXLEN, approximate=True)
            elif isinstance(ev, Restarted):
                job.attempt += 1
                job.text.clear()
                job.first_token_at = None
            elif isinstance(ev, Done):
                if job.timed_out:
                    self._fail(job, f"timed out: ran longer than {job.deadline - job.claimed_at:.0f}s", pipe)
                else:
                    self._succeed(job, ev, now, pipe)
            elif isinstance(ev, Failed):
                self._fail(job, ev.error, pipe)
        return n_tokens

    # -- endings ----------------------------------------------------------------------------------

    def result_of(self, job: ClaimedJob, done: Done, now: float) -> dict[str, Any]:
        queue_ms = (job.claimed_at - job.enqueued_at) * 1000 if job.enqueued_at else None
        ttft_ms = (job.first_token_at - job.claimed_at) * 1000 if job.first_token_at else None
        total_s = now - job.claimed_at
        gen_s = now - job.first_token_at if job.first_token_at else 0.0
        return {
            "job_id": job.id,
            "text": "".join(job.text),
            "finish_reason": done.finish_reason,
            "usage": {
                "prompt_tokens": done.prompt_tokens,
                "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens,
            },
            "worker": self.name,
            "backend": str(done.extra.get("backend", self.backend.name)),
            "attempt": job.attempt,
            "timings": {
                "queue_ms": _round(queue_ms),
                "ttft_ms": _round(ttft_ms),
                "total_ms": _round(total_s * 1000),
                "tokens_per_s": _round(done.completion_tokens / gen_s if gen_s > 0 else None),
            },
        }

    def _succeed(self, job: ClaimedJob, done: Done, now: float, pipe: Any) -> None:
        result = self.result_of(job, done, now)
        rqjobs.store_success(job, result, self.name, self.settings.result_ttl, pipe)
        self._close_stream(job, stream.encode_done(job.attempt, result), pipe)
        self.inflight.pop(job.id, None)
        self.counters.jobs_done += 1

    def _fail(self, job: ClaimedJob, reason: str, pipe: Any | None = None) -> None:
        """Fail one job with a readable reason; never raises for the job's sake."""
        log.warning("job %s failed: %s", job.id, reason)
        own = pipe is None
        p = self.redis.pipeline(transaction=False) if own else pipe
        rqjobs.store_failure(job, reason, self.name, self.settings.result_ttl, p)
        err = rqjobs.error_payload(reason, job, self.name, self.backend.name)
        self._close_stream(job, stream.encode_error(job.attempt, err), p)
        if own:
            p.execute()
        self.inflight.pop(job.id, None)
        self.counters.jobs_failed += 1

    def _finish_cancelled_before_start(self, job: ClaimedJob) -> None:
        with self.redis.pipeline(transaction=False) as pipe:
            self._succeed(job, Done(job.id, "cancelled", 0, 0), time.time(), pipe)
            pipe.execute()

    def _close_stream(self, job: ClaimedJob, entry: dict[str, Any], pipe: Any) -> None:
        key = stream_key(job.id)
        pipe.xadd(key, entry, maxlen=stream.STREAM_MAXLEN, approximate=True)
        pipe.expire(key, self.settings.result_ttl)
        pipe.delete(cancel_key(job.id))
        self.claimer.release(job.id, pipe)

    def requeue_all(self, why: str) -> None:
        """Put every in-flight job back at the front of its queue (drain timeout, shutdown)."""
        for job_id, job in list(self.inflight.items()):
            self.backend.cancel(job_id)
            if job.execution is not None and job.job is not None:
                with self.redis.pipeline(transaction=False) as pipe:
                    job.execution.delete(job.job, pipe)
                    pipe.execute()
            self.claimer.requeue(job_id, job.queue, bump_attempt=True)
            log.info("requeued %s (%s)", job_id, why)
            self.inflight.pop(job_id, None)


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)
