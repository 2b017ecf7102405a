"""The worker loop: claim -> admit -> step -> write, with up to `slots` jobs in flight.

    while not stopping:
        claim up to backend.free_slots() jobs     (block briefly only when nothing is in flight)
        events = backend.step()                   (one batched decode / drain of HTTP streams)
        events change the jobs' state in memory  (text deltas, endings, restarts)
        flush (every stream_interval; a first token, an ending or a hand-back at once): one
               pipeline of text deltas + cancel checks, then the endings in one MULTI that
               applies only to jobs this worker still holds, then requeues (worker/serving/endings.py)

Redis outages: generation does not wait for Redis. Unwritten deltas and endings stay on the jobs
and are flushed, in order, when Redis answers again (RedisLink paces the retries). Past
OUTAGE_BUFFER_ENTRIES unwritten deltas the job holding most is cancelled and handed back to its
queue once Redis is back. After an outage the loop compares its jobs with its in-flight list: a
job the reaper took meanwhile is dropped here; an id claimed whose reply was lost is started.

A heartbeat thread (worker/liveness/heartbeat.py) keeps the worker alive and reaps dead workers' jobs.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from redis import Redis

from backends.base import (
    Backend,
    BackendUnavailable,
    Bilingual,
    Done,
    Event,
    Failed,
    JobRejected,
    Restarted,
    Resumable,
    Token,
)
from backends.contract.embed import EmbedRequest
from backends.contract.keys import cancel_key, job_key, queue_names
from backends.contract.rerank import RerankRequest
from backends.contract.retry import OUTAGE_ERRORS
from backends.contract.schema import DEFAULT_TENANT
from backends.contract.text_ops import TextRequest
from backends.shelf import ModelShelf
from worker.assembly import job_hooks
from worker.claiming import handover
from worker.claiming.models import make_claims
from worker.claiming.priority import ClaimPolicy
from worker.hooks import JobHook
from worker.job import ClaimedJob, Ending, tenant_of, unloaded
from worker.redis_link import RedisLink
from worker.serving import endings, limits, rqjobs
from worker.serving.burst import BurstSummary
from worker.serving.counters import EngineHold, WorkerCounters
from worker.serving.embed_jobs import EmbedQueue
from worker.serving.endings import AttemptWriter, Contended
from worker.serving.pacing import EVERYTHING, Due, WritePacer
from worker.serving.rerank_jobs import RerankQueue
from worker.serving.rqjobs import BadJob, CancelledByRQ, NotToRun
from worker.serving.stall import ADMITTING, STEPPING, LoopWatch
from worker.serving.text_jobs import TextJobs
from worker.settings import FleetSettings

log = logging.getLogger("fleet.worker")
IDLE_WAIT = 0.25  # seconds an idle worker blocks on the wake list before polling the queues
OUTAGE_BUFFER_ENTRIES = 16_384  # unwritten text deltas held through a Redis outage, all jobs
GIVE_WAY_EVERY = 0.02  # seconds between looks for tenants waiting below their share of the slots


class _WokenBySignal(Exception):
    """Raised by the signal handler into an idle wait on the wake list: a stop is immediate."""


class FleetWorker:
    def __init__(self, settings: FleetSettings, backend: Backend, redis: Redis, name: str,
                 link: RedisLink | None = None, hooks: Sequence[JobHook] | None = None) -> None:
        """`hooks`: what job writes carry besides their own (worker/hooks/__init__.py); None: assembly's."""
        self.settings = settings
        self.backend = backend
        self.embeds = EmbedQueue()  # embedding jobs, run between generation steps
        self.reranks = RerankQueue()  # rerank jobs, likewise
        self.texts = TextJobs()  # text jobs, answered on a thread of their own beside the steps
        self.sides = (self.embeds, self.reranks, self.texts)  # jobs beside generation: slots, cancels
        self.redis = redis
        self.name = name
        self.link = link or RedisLink()
        # the pool's queues, or each catalogue model's (worker/claiming/models.py)
        self.jobs_ended = threading.Event()  # tells the heartbeat to refresh the status now
        self.claims = make_claims(redis, name, settings, backend, self.jobs_ended)
        self.claimer, self.queues = self.claims.claimer, self.claims.queues
        hooks = job_hooks(settings) if hooks is None else hooks
        self.writes = AttemptWriter(redis, name, backend.name, settings.result_ttl, hooks)
        self.claim_policy = ClaimPolicy(backend.slots, settings.reserved_slots, queue_names(settings.pool),
                                        batch_share=settings.batch_share)
        self.inflight: dict[str, ClaimedJob] = {}  # running, or ended and not yet written
        # handed back once Redis allows: (job, why, counted against max_attempts)
        self.to_requeue: dict[str, tuple[ClaimedJob, str, bool]] = {}
        self._next_give_way = 0.0  # when the loop next looks for tenants below their share
        self.unstarted: list[tuple[bytes, str, int | None]] = []  # claimed (at server ms); not started
        self.budget = limits.budget_for(settings.backend)
        self.counters = WorkerCounters()
        self.outcomes: Counter[str] = Counter()  # jobs this loop let go of, by outcome (burst summary)
        self.stopping = threading.Event()
        self._drain_deadline: float | None = None
        self._reconcile_at = time.monotonic() + self.settings.reconcile_interval
        self.engine_hold = EngineHold()  # after an engine failure: pause claiming (read by the heartbeat)
        self._waiting_idle = False  # in the blocking wait on the wake list (the signal handler looks)
        self.pacer = WritePacer(settings.stream_interval)  # when a step's writes go out
        self.watch = LoopWatch()  # the engine call the loop is in, for the watchdog (liveness/watchdog.py)

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
        if self._waiting_idle:  # cut the wait short (redis-py drops a connection a raise interrupts)
            self._waiting_idle = False
            raise _WokenBySignal

    def stop(self) -> None:
        self._drain_deadline = time.monotonic() + self.settings.drain_grace
        self.stopping.set()

    def drain_overdue(self, now: float) -> bool:
        """Stopped, and the drain's grace is over (a second signal ends it at once)."""
        return self.stopping.is_set() and self._drain_deadline is not None and now > self._drain_deadline

    def run(self) -> None:
        """Serve until stop(); then finish in-flight jobs within the grace period, requeue the rest."""
        self.counters.state = "idle"
        while not self.stopping.is_set():
            self.run_once()
        self.counters.state = "draining"
        self._hand_back_unstarted()
        while (self.inflight or self.to_requeue) and time.monotonic() < (self._drain_deadline or 0):
            self._guarded(self._step)
        self.requeue_all("worker stopped")
        self.counters.state = "stopped"

    def run_once(self) -> None:
        self._guarded(self._serve_once)

    def run_until_idle(self, timeout: float | None = None) -> BurstSummary:
        """Burst mode (rq's `work(burst=True)`, arq's `burst`): turn the loop until no job is
        queued for this pool and none is in flight here, then return what ended, by outcome.
        With Redis unreachable it is never idle (the queues cannot be read): it keeps buffering
        until Redis is back or `timeout` passes (then `idle` is False and jobs stay in flight)."""
        started, before = time.monotonic(), Counter(self.outcomes)
        deadline = started + timeout if timeout is not None else float("inf")
        idle = False
        while not self.stopping.is_set() and time.monotonic() < deadline:
            self.run_once()
            if self._holds_nothing() and self.link.up and self._queues_empty():
                idle = True
                break
        ended = Counter(self.outcomes)
        ended.subtract(before)
        return BurstSummary(idle, {k: n for k, n in ended.items() if n > 0},
                            round(time.monotonic() - started, 3))

    def _holds_nothing(self) -> bool:
        engine_busy = self.backend.free_slots() < self.backend.slots
        return not (self.inflight or self.to_requeue or self.unstarted or engine_busy)

    def _queues_empty(self) -> bool:
        try:
            return self.claimer.nothing_queued()
        except OUTAGE_ERRORS as e:
            self.link.failed(e, "checking the queues")
            return False

    def _serve_once(self) -> None:
        if self.link.ready():
            self._talk("claiming", self._claim)
        # the engine may still hold jobs this loop let go of (cancelled, awaiting their Done)
        engine_busy = self.backend.free_slots() < self.backend.slots
        if self.inflight or self.to_requeue or engine_busy:
            self.counters.state = "busy"
            self._step()
        elif not self.link.up:
            self.counters.state = "waiting for redis"
            time.sleep(min(max(self.link.wait_left(), 0.01), IDLE_WAIT))
        else:
            self.counters.state = "idle"
            if self.engine_hold.down:  # the engine failed: nothing to do until the backoff passes
                time.sleep(min(max(self.engine_hold.seconds_left(), 0.01), IDLE_WAIT))

    def _guarded(self, work: Callable[[], None]) -> None:
        """One turn of the loop; a bug met by one job must not end the worker."""
        try:
            work()
        except Exception:
            log.exception("worker loop error (continuing)")
            time.sleep(0.1)

    def _talk(self, doing: str, work: Callable[[], None]) -> bool:
        """Run a Redis exchange; an outage is recorded (not raised) and retried on the backoff."""
        try:
            if self._reconcile_at <= time.monotonic():
                self._reconcile()
            work()
        except OUTAGE_ERRORS as e:
            self.link.failed(e, doing)
            self._reconcile_at = 0.0  # once back, first check what Redis says we hold
            return False
        self.link.succeeded()
        return True

    # -- claiming ---------------------------------------------------------------------------------

    def _claim(self) -> None:
        self._start_unstarted()
        free, held = self._room()
        if free <= 0 and set(held) - {DEFAULT_TENANT} and time.monotonic() >= self._next_give_way:
            # every slot taken: tenants above their share give way to one below (worker/claiming/handover.py)
            self._next_give_way = time.monotonic() + GIVE_WAY_EVERY
            for job in handover.give_way(self.inflight.values(), *self.claimer.starved(held)):
                self._hand_back(job, "preempted: its tenant held more than its share", counted=False)
                self.counters.preempted += 1
            free, held = self._room()  # an engine frees a cancelled job's slot at once: claim now
        if free <= 0 or not self.engine_hold.ready(self.backend.probe):
            return
        limits = self.claim_policy.limits(free, [j.queue for j in self.inflight.values()])
        claimed = self.claims.claim(free, limits, held)
        if not claimed and not self.inflight and not self.to_requeue:
            # idle: sleep on the wake list, then look again (plain-RQ producers never push it)
            if not self._wait_for_wake():
                return
            claimed = self.claims.claim(free, limits, held)
        self.unstarted.extend((raw, queue, self.claimer.server_ms) for raw, queue in claimed)
        self._start_unstarted()

    def _room(self) -> tuple[int, Counter[str]]:
        """Free slots, and the jobs in flight by tenant (their share of the slots)."""
        side = sum(queue.held() for queue in self.sides)
        return (self.backend.free_slots() - len(self.unstarted) - side,
                Counter(tenant_of(j) for j in self.inflight.values()))

    def _wait_for_wake(self) -> bool:
        """Block up to IDLE_WAIT on the wake list; False when a stop signal cut the wait short."""
        try:
            try:
                self._waiting_idle = True
                self.redis.blpop(self.claims.wake_keys, timeout=IDLE_WAIT)
            finally:
                self._waiting_idle = False
        except _WokenBySignal:  # also when it lands in the finally above
            return False
        return True

    def _start_unstarted(self) -> None:
        while self.unstarted:
            raw_id, queue, claimed_ms = self.unstarted[0]
            try:
                self._start(raw_id, queue, claimed_ms)
            except OUTAGE_ERRORS:
                raise  # stays first in line; started once Redis is back
            except Exception as e:  # one bad job must never take the worker down
                log.exception("job %r could not start", raw_id)
                job_id = raw_id.decode("utf-8", "replace")
                self._end(self.inflight.get(job_id) or unloaded(self.redis, job_id, queue, 1),
                          Ending(error=f"internal error starting the job: {e}"))
            self.unstarted.pop(0)

    def _start(self, raw_id: bytes, queue: str, claimed_ms: int | None = None) -> None:
        try:
            job_id = raw_id.decode()
        except UnicodeDecodeError:  # failed visibly, by its raw id
            self.writes.refuse(raw_id, queue, "refused: job id is not UTF-8 text")
            self.counters.jobs_failed += 1
            self.outcomes["failed"] += 1
            return
        if job_id in self.inflight or job_id in self.to_requeue:
            log.warning("job %s was in the queue twice; the second copy is dropped", job_id)
            self.claimer.drop(job_id)
            return
        # the engine of the job's model (a catalogue worker's may load it now); a chat the engine
        # takes in its model's own dialect is not lowered to the generic tools
        backend = self.backend.engine_for(queue) if isinstance(self.backend, ModelShelf) else self.backend
        try:
            job = rqjobs.load(self.redis, job_id, queue, self.settings.job_timeout, self.settings.queue_ttl,
                              me=self.name, budget=self.budget, claimed_ms=claimed_ms,
                              as_sent=backend.speaks if isinstance(backend, Bilingual) else None)
        except NotToRun as e:
            log.warning("claimed %s but not running it: %s", job_id, e)
            self.claimer.drop(job_id)
            return
        except BadJob as e:
            self._end(e.claimed, Ending(error=str(e)))
            return
        except CancelledByRQ as e:
            self._end_cancelled(e.claimed)
            return
        if self.redis.exists(cancel_key(job_id)):
            self._end_cancelled(job)
            return
        # fenced: only while this worker holds it (the reaper may have taken it meanwhile)
        if not self.writes.start(job, self.settings.job_timeout + 60):
            log.warning("job %s was taken over before it started here; dropped", job_id)
            return
        self.inflight[job_id] = job
        request = job.request
        assert request is not None
        side_job = isinstance(request, TextRequest | EmbedRequest | RerankRequest)
        resumable = isinstance(backend, Resumable) and not side_job
        delivered = handover.resume_text(self.redis, job) if resumable else ""  # Redis: outside the watch
        try:
            with self.watch.engine(ADMITTING, lambda: (job_id,)):
                if isinstance(request, TextRequest):  # a tokenizer call: on the text jobs' thread
                    self.texts.add(job_id, request, backend)
                elif isinstance(request, EmbedRequest):
                    self.embeds.add(job_id, request, backend)
                elif isinstance(request, RerankRequest):
                    self.reranks.add(job_id, request, backend)
                elif isinstance(backend, Resumable) and handover.resume(backend, job, request, delivered):
                    self.counters.resumed += 1  # continues its last attempt's text (claiming/handover.py)
                else:
                    backend.admit(job_id, request)
        except JobRejected as e:
            job.ending = Ending(error=str(e))
        except BackendUnavailable as e:
            self._retry_or_fail(job, f"backend unavailable: {e}")

    def _end_cancelled(self, job: ClaimedJob) -> None:
        self._end(job, endings.cancelled(job, self.name, self.backend.name))

    # -- one step ---------------------------------------------------------------------------------

    def _step(self) -> None:
        # wait for events while the engine holds work, or while Redis is away (no spinning through
        # an outage); endings still to flush (a refused or finished job) go out at once
        busy = self.backend.free_slots() < self.backend.slots
        # only text jobs running (on their thread): wait for one rather than spin on the claim
        only_texts = not busy and not self.embeds.held() and not self.reranks.held() and self.link.ready()
        with self.watch.engine(STEPPING, self._in_step):
            events = (self.embeds.step() + self.reranks.step() + self.texts.step(0.02 if only_texts else 0.0)
                      + self.backend.step(0.05 if busy or not self.link.ready() else 0.0))
        now = time.monotonic()  # deadlines, durations: this host's clock, never the wall (hosts differ)
        n_tokens = self._apply(events, now)
        self.counters.record_step(n_tokens)
        for job in self.inflight.values():
            if job.ending is None and now > job.deadline and not job.timed_out:
                job.timed_out = True  # the Done(cancelled) that follows becomes a failure
                self._cancel(job.id)
        if self.link.ready() and (due := self.pacer.due(now, self.inflight.values(), self.to_requeue)):
            self._talk("writing results", lambda: self._flush(due))
        if not self.link.up:
            self._bound_buffer()

    def _in_step(self) -> tuple[str, ...]:
        """The jobs a stuck step is blamed on: the ones it was starting (no token yet), else all."""
        running = [j for j in list(self.inflight.values()) if j.ending is None]
        return tuple(j.id for j in [j for j in running if j.first_token_at is None] or running)

    def _apply(self, events: list[Event], now: float) -> int:
        n_tokens = 0
        for ev in events:
            job = self.inflight.get(ev.job_id)
            if job is None or job.ending is not None:
                continue  # a late event of a job handed back or already ended
            if isinstance(ev, Token):
                if job.first_token_at is None:
                    job.first_token_at = now
                job.completion_tokens += ev.n_tokens
                n_tokens += ev.n_tokens
                if ev.text:
                    job.text.append(ev.text)
                    job.unsent.append(ev.text)
            elif isinstance(ev, Restarted):  # e.g. moved to a fallback engine: a new attempt
                job.attempt += 1
                job.text.clear()
                job.unsent.clear()
                job.sent, job.attempt_dirty, job.first_token_at = 0, True, None
                job.restart_reason = ev.reason
            elif isinstance(ev, Done):
                self.engine_hold.served()
                job.ending = endings.finished(job, ev, now, self.name, self.backend.name)
            elif isinstance(ev, Failed):
                if ev.retryable:
                    self._retry_or_fail(job, ev.error)
                else:
                    job.ending = Ending(error=ev.error)
        return n_tokens

    def _retry_or_fail(self, job: ClaimedJob, reason: str) -> None:
        """The engine (not the job) failed: hand the job back for another attempt, and pause
        claiming until the engine looks healthy; after max_attempts, fail it."""
        self.engine_hold.failed()
        if job.attempt - job.drains >= self.settings.max_attempts:
            job.ending = endings.gave_up(job, reason)
        else:
            log.warning("job %s: %s; retrying it (attempt %d)", job.id, reason, job.attempt + 1)
            self._hand_back(job, reason)

    # -- writing ----------------------------------------------------------------------------------

    def _flush(self, due: Due = EVERYTHING) -> None:
        """Everything Redis has not seen yet, in order: deltas, then endings, then hand-backs;
        with them, a look at the running jobs' cancel flags (what is `due`: worker/serving/pacing.py)."""
        jobs = list(self.inflight.values())
        checked = [j for j in jobs if j.ending is None] if due.cancels else []
        with self.redis.pipeline(transaction=False) as pipe:
            counts = self.writes.queue_text(jobs, pipe) if due.text else []
            for job in checked:  # a producer's cancel, or RQ's own job.cancel()
                pipe.exists(cancel_key(job.id))
                pipe.hget(job_key(job.id), "status")
            replies = pipe.execute(raise_on_error=False)
        if due.text:
            self.writes.text_sent(jobs, counts)
        checks = replies[len(replies) - 2 * len(checked):]
        for job, cancelled, status in zip(checked, checks[::2], checks[1::2], strict=True):
            if cancelled is True or cancelled == 1 or status == b"canceled":
                self._cancel(job.id)
        self._write_endings()
        self._write_requeues()

    def _write_endings(self) -> None:
        ended = [j for j in self.inflight.values() if j.ending is not None]
        if not ended:
            return
        try:
            written = self.writes.end(ended)
        except Contended as e:
            log.warning("final writes postponed: %s", e)
            return
        for job in ended:
            del self.inflight[job.id]
            if job.id not in written:
                log.warning("job %s was taken over while this worker was cut off; attempt %d's "
                            "result is dropped", job.id, job.attempt)
                self.outcomes["taken over"] += 1
            elif job.ending is not None and job.ending.error is None:
                self.counters.jobs_done += 1
                self.outcomes[endings.outcome(job.ending)] += 1
            else:
                self.counters.jobs_failed += 1
                self.outcomes["failed"] += 1
        self.jobs_ended.set()

    def _write_requeues(self) -> None:
        for job_id, (job, why, counted) in list(self.to_requeue.items()):
            attempt = self.writes.requeue(job_id, job.queue, why, counted=counted)
            del self.to_requeue[job_id]
            if attempt < 0:
                continue  # no longer ours: the reaper already handed it back
            self.counters.jobs_requeued += 1
            self.outcomes["requeued"] += 1
            log.info("requeued %s at the front for attempt %d (%s)", job_id, attempt + 1, why)

    def _cancel(self, job_id: str) -> None:
        if not any(side.cancel(job_id) for side in self.sides):
            self.backend.cancel(job_id)

    def _end(self, job: ClaimedJob, ending: Ending) -> None:
        """A job that ends before reaching the engine; written with the next flush."""
        job.ending = ending
        self.inflight[job.id] = job

    def _hand_back(self, job: ClaimedJob, why: str, counted: bool = True) -> None:
        """`counted=False`: not the job's or the engine's failure (a drain, a full outage buffer),
        so it does not use up one of the job's max_attempts."""
        if job.ending is None:
            self._cancel(job.id)  # its late Done is ignored: the job is no longer in flight
        job.unsent.clear()
        self.inflight.pop(job.id, None)
        self.to_requeue[job.id] = (job, why, counted)

    # -- Redis outages ----------------------------------------------------------------------------

    def _bound_buffer(self) -> None:
        for job in handover.over_buffer(self.inflight.values(), OUTAGE_BUFFER_ENTRIES):
            log.warning("job %s: Redis unreachable, the outage buffer is full; it will be requeued", job.id)
            self._hand_back(job, "outage buffer full", counted=False)

    def _reconcile(self) -> None:
        """Agree with Redis on what this worker holds (after an outage, and every few seconds)."""
        self._reconcile_at = time.monotonic() + self.settings.reconcile_interval
        held = Counter(self.claimer.held_raw())
        for job_id in list(self.inflight):
            if job_id.encode() not in held:
                job = self.inflight.pop(job_id)
                if job.ending is None:
                    self._cancel(job_id)
                log.warning("job %s was taken over (this worker was presumed dead); dropped here", job_id)
        for job_id in list(self.to_requeue):
            if job_id.encode() not in held:
                del self.to_requeue[job_id]
        known = {j.encode() for j in (*self.inflight, *self.to_requeue)}
        known |= {raw for raw, _, _ in self.unstarted}
        for raw_id, copies in held.items():
            if raw_id not in known:  # claimed, but the reply never arrived: start it now
                self.unstarted.append(handover.never_started(self.redis, raw_id, self.queues))
                log.warning("%r is in this worker's in-flight list but never started; starting it", raw_id)
            for _ in range(copies - 1):  # the same id pushed twice: one copy runs
                self.claimer.drop(raw_id)

    # -- shutdown ---------------------------------------------------------------------------------

    def _hand_back_unstarted(self) -> None:
        for raw_id, queue, _ in self.unstarted:
            # not text: never ran, the reaper fails it; Redis away: the reaper hands it back
            with contextlib.suppress(UnicodeDecodeError, *OUTAGE_ERRORS):
                self.writes.put_back(raw_id.decode(), queue)
        self.unstarted.clear()

    def requeue_all(self, why: str) -> None:
        """Hand every unfinished job back to the front of its queue (drain timeout, shutdown) and
        write what finished. With Redis away, they stay in this worker's in-flight list, where the
        reaper of another worker (or this one's next life) finds them."""
        for job in [j for j in self.inflight.values() if j.ending is None]:
            self._hand_back(job, why, counted=False)
        if not self._talk("handing jobs back", self._flush):
            log.warning("Redis unreachable at exit: %d jobs stay in %s for the reaper",
                        len(self.inflight) + len(self.to_requeue), self.claimer.inflight)
