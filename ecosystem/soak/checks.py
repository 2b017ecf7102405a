"""The invariants (verdict.py lists them): some sampled while the run goes on (`Monitor`), the
rest once the fleet is quiet again (`quiet_checks`), after traffic stopped and every queue,
in-flight list and batch drained (bounded: not draining is a violation of its own).

What a client was told is judged against the faults' windows: a 503 `redis_unavailable` is the
gateway's documented answer while Redis is down (and for a few seconds after, until it sees
Redis again; its 503 `no_workers` too, until the workers' status keys, expired meanwhile, are
written again), a broken connection is what a client of a killed gateway gets, and a 504 is the
short-timeout gateway's answer by design. Anything else 5xx, a hang, or a 2xx without a final
answer is a violation.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from redis import Redis

from backends.contract.keys import batch_key, batch_lines_key, worker_key
from backends.contract.replies import as_str
from ecosystem.local.fleet_keys import keys_without_ttl
from ecosystem.local.records import final_entries
from ecosystem.soak.client import Clock, Record
from ecosystem.soak.faults import FaultRecord
from ecosystem.soak.fleet import SoakFleet
from ecosystem.soak.jobs import JobInfo, ended_once, scan_jobs
from ecosystem.soak.plan import TENANTS
from ecosystem.soak.state import waiting
from ecosystem.soak.tenancy import LimitMonitor, rate_violations, usage_violations
from ecosystem.soak.traffic import BatchRef
from ecosystem.soak.verdict import Violation

# seconds after Redis is back during which a gateway may still answer 503: until it reads Redis
# again, and until the workers' status keys (expired while Redis was down) are written again
REDIS_GRACE = 10.0
GATEWAY_GRACE = 2.0  # seconds around a gateway's restart in which its clients may lose the connection
PERSISTS = 10.0  # seconds a queue-model violation must last while traffic runs to count
BATCH_DONE = ("completed", "cancelled", "failed", "expired")


def queue_model_violations(redis: Redis) -> list[tuple[str, str]] | None:
    """(invariant, detail) of each broken queue-model invariant; None while the check is not
    available (the module is the queue model's own: backends/contract/queue/invariants.py)."""
    try:
        from backends.contract.queue.invariants import queue_violations
    except ImportError:
        return None
    out = []
    for v in queue_violations(redis):
        out.append((str(getattr(v, "invariant", "queue_model")), str(getattr(v, "detail", v))))
    return out


class Monitor:
    """Samples while the run goes on: tenants' limits every half second, the queue model's
    invariants every two seconds or ten times as long as the last check took (it reads every job:
    a long run keeps thousands); a queue-model violation counts once it has lasted PERSISTS
    seconds (between two keys a busy fleet is mid-move, a stuck one stays)."""

    def __init__(self, redis: Callable[[], Redis], clock: Clock) -> None:
        self.redis = redis
        self.clock = clock
        self.limits = LimitMonitor()
        self.queue_seen: dict[str, float] = {}  # violation text -> first seen
        self.queue_lasting: dict[str, Violation] = {}
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="soak-monitor")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        r = self.redis()
        next_model = 2.0
        while not self._stop.wait(0.5):
            try:
                self.limits.sample(r, self.clock.now())
                if self.clock.now() >= next_model:
                    took = time.monotonic()
                    self._queue_model(r)
                    took = time.monotonic() - took
                    next_model = self.clock.now() + max(2.0, 10 * took)
            except Exception:  # Redis down (a fault): the next sample reads again
                self.errors += 1

    def _queue_model(self, r: Redis) -> None:
        found = queue_model_violations(r)
        if found is None:
            return
        now = self.clock.now()
        texts = {f"{inv}: {detail}" for inv, detail in found}
        self.queue_seen = {t: self.queue_seen.get(t, now) for t in texts}
        for text, since in self.queue_seen.items():
            if now - since >= PERSISTS and text not in self.queue_lasting:
                self.queue_lasting[text] = Violation("queue_model", f"{text} (lasted {now - since:.0f}s "
                                                     "while traffic ran)", since)

    def violations(self) -> list[Violation]:
        return [*self.limits.violations(), *self.queue_lasting.values()]


# -- quiet ---------------------------------------------------------------------------------------


def wait_quiet(redis: Redis, batches: list[BatchRef], timeout: float) -> list[Violation]:
    """Until every queue and in-flight list is empty and every batch ended; a violation naming
    what is left if that takes longer than `timeout`."""
    deadline = time.monotonic() + timeout
    left: list[str] = []
    while time.monotonic() < deadline:
        try:
            snap = waiting(redis)
            if snap.empty:  # once the named lists are empty, any list at all
                snap = waiting(redis, scan=True)
            open_batches = [b.id for b in batches
                            if as_str(redis.hget(batch_key(b.id), "state")) not in BATCH_DONE]
        except Exception as e:  # a Redis that is not back is not quiet
            left = [f"Redis: {e}"]
            time.sleep(0.5)
            continue
        left = snap.describe() + [f"batch {b} has not ended" for b in open_batches]
        if not left:
            return []
        time.sleep(0.5)
    return [Violation("fleet_quiet", f"not quiet {timeout:.0f}s after traffic stopped: "
                      + "; ".join(left[:12]))]


def probe(fleet: SoakFleet, send: Callable[[int, int], Record]) -> tuple[list[Record], list[Violation]]:
    """Every gateway answers and every worker runs a job: short requests through each gateway
    until each worker has ended one (`send(gateway, n)` sends the n-th probe)."""
    r = fleet.redis.client()
    served: set[str] = set()
    records: list[Record] = []
    out: list[Violation] = []
    answered: set[int] = set()
    for n in range(60):
        record = send(n % len(fleet.gateways), n)
        records.append(record)
        if record.outcome == "timeout_504" and record.gateway == 1:
            continue  # the short-timeout path's answer: the gateway is alive, the job was slow
        if record.outcome != "ok":
            out.append(Violation("processes", f"probe {n} through gateway {record.gateway} did not get an "
                                 f"answer: {record.outcome} {record.status} {record.message}"))
            continue
        answered.add(record.gateway)
        for job_id in record.job_ids:
            with contextlib.suppress(Exception):
                for ev in final_entries(r, job_id):
                    served.add(str((ev.data or {}).get("worker")))
        if served >= set(fleet.workers) and len(answered) == len(fleet.gateways):
            break
    idle = sorted(set(fleet.workers) - served)
    if idle:
        out.append(Violation("processes", f"workers {', '.join(idle)} ran none of {len(records)} probe jobs"))
    silent = sorted(set(range(len(fleet.gateways))) - answered)
    if silent:
        out.append(Violation("processes", f"gateways {silent} answered none of {len(records)} probes"))
    return records, out


def process_violations(fleet: SoakFleet) -> list[Violation]:
    out = []
    r = fleet.redis.client()
    for name, w in fleet.workers.items():
        restarts = fleet.incarnations.count.get(name, 1) - 1
        if not w.alive():
            out.append(Violation("processes", f"worker {name} is not running (exit {w.process.returncode}, "
                                 f"{restarts} restarts): {w.output()[-300:]}"))
        elif not r.exists(worker_key(name)):
            out.append(Violation("processes", f"worker {name} runs but is not registered"))
    for i, gw in enumerate(fleet.gateways):
        name = fleet.gateway_name(i)
        if not gw.alive():
            code = gw.process.returncode
            out.append(Violation("processes", f"gateway {name} is not running (exit {code})"))
            continue
        try:
            status = httpx.get(f"{fleet.gateway_url(i)}/health", timeout=5).status_code
        except httpx.HTTPError as e:
            status = f"{type(e).__name__}"  # type: ignore[assignment]
        if status != 200:
            out.append(Violation("processes", f"gateway {name} answers /health with {status}"))
    return out


# -- what clients were told ---------------------------------------------------------------------------


def effective_priority(record: Record) -> str:
    ceiling = TENANTS.get(record.tenant, {}).get("max_priority", "high")
    asked = record.priority or "default"
    order = ("high", "default", "low")
    return max(asked, ceiling, key=order.index) if asked in order else asked


def _overlaps(record: Record, start: float, end: float) -> bool:
    return record.started <= end and record.ended >= start


def client_violations(records: list[Record], faults: list[FaultRecord], fleet: SoakFleet) -> list[Violation]:
    redis_down = [(f.started, f.down_until + REDIS_GRACE) for f in faults
                  if f.kind in ("redis_restart", "sentinel_failover")]
    gateway_down = {fleet.gateway_name(i): [(f.started - GATEWAY_GRACE, f.down_until + GATEWAY_GRACE)
                                            for f in faults if f.kind == "gateway_kill9"
                                            and f.target == fleet.gateway_name(i)]
                    for i in range(len(fleet.gateways))}
    out = []
    for rec in records:
        what = f"request {rec.id} ({rec.kind}, tenant {rec.tenant}, gateway {rec.gateway}, " \
               f"jobs {rec.job_ids})"
        o = rec.outcome
        if o == "hung":
            out.append(Violation("no_hang", f"{what}: {rec.message}", rec.started))
        elif o == "unclear":
            said = rec.message or "no final answer"
            out.append(Violation("told_clearly", f"{what}: status {rec.status}, {said}", rec.started))
        elif o == "soak_error":
            out.append(Violation("told_clearly", f"{what}: the soak's own client failed: {rec.exception}",
                                 rec.started))
        elif o == "connection_lost":
            windows = gateway_down.get(fleet.gateway_name(rec.gateway), [])
            if not any(_overlaps(rec, a, b) for a, b in windows):
                out.append(Violation("told_clearly", f"{what}: the connection broke with no gateway down: "
                                     f"{rec.exception}", rec.started))
        elif o in ("redis_503", "no_workers_503"):
            if not any(_overlaps(rec, a, b) for a, b in redis_down):
                out.append(Violation("no_5xx", f"{what}: 503 {rec.code} while Redis was up: {rec.message}",
                                     rec.started))
        elif o == "timeout_504" or (o == "error_event" and rec.code == "timeout"):
            # the short-timeout gateway answers 504 by design; a low-priority request may wait
            # behind interactive work for as long as it lasts (docs/batch.md, "Priorities")
            if rec.gateway != 1 and effective_priority(rec) != "low":
                out.append(Violation("no_5xx", f"{what}: {rec.status} timeout after {rec.seconds:.1f}s "
                                     f"on the gateway with the long request_timeout: {rec.message}",
                                     rec.started))
        elif o == "server_error":
            out.append(Violation("no_5xx", f"{what}: {rec.status} {rec.message}", rec.started))
        if rec.expect_refusal and o not in ("refused", "connection_lost", "redis_503", "no_workers_503"):
            out.append(Violation("bad_input_refused", f"{what}: bad input answered {rec.status} ({o}): "
                                 f"{rec.message}", rec.started))
    return out


# -- jobs and batches ---------------------------------------------------------------------------------


def job_violations(jobs: dict[str, JobInfo]) -> list[Violation]:
    out = []
    for info in jobs.values():
        wrong = ended_once(info)
        if wrong:
            where = f"tenant {info.tenant}, {info.origin}"
            out.append(Violation("ended_once", f"job {info.id} ({where}): {wrong}"))
    return out


def batch_violations(redis: Redis, batches: list[BatchRef]) -> list[Violation]:
    out = []
    for b in batches:
        state = {as_str(k): as_str(v) for k, v in redis.hgetall(batch_key(b.id)).items()}
        if not state:
            out.append(Violation("batch_lines", f"batch {b.id} of {b.tenant}: its record is gone"))
            continue
        lines = [as_str(v) or "" for v in redis.hvals(batch_lines_key(b.id))]
        open_lines = sum(v.startswith("q") for v in lines)
        ended = {s: sum(v.startswith(s) for v in lines) for s in "dfx"}
        counts = {k: int(state.get(k) or 0) for k in ("completed", "failed", "cancelled")}
        problems = []
        if state.get("state") not in BATCH_DONE:
            problems.append(f"state {state.get('state')}")
        if open_lines:
            problems.append(f"{open_lines} lines never ended")
        if len(lines) != b.lines:
            problems.append(f"{len(lines)} lines recorded of {b.lines}")
        if [ended["d"], ended["f"], ended["x"]] != list(counts.values()):
            problems.append(f"lines d/f/x {ended['d']}/{ended['f']}/{ended['x']} but counts "
                            f"{counts['completed']}/{counts['failed']}/{counts['cancelled']}")
        if problems:
            out.append(Violation("batch_lines", f"batch {b.id} of {b.tenant}: " + "; ".join(problems)))
    return out


def quiet_checks(redis: Redis, records: list[Record], batches: list[BatchRef], faults: list[FaultRecord],
                 fleet: SoakFleet, clock: Clock) -> tuple[list[Violation], dict[str, Any]]:
    """Every invariant checked once the fleet is quiet; and what the checks counted."""
    known = {j for r in records for j in r.job_ids}
    jobs = scan_jobs(redis, known)
    out = [*job_violations(jobs), *batch_violations(redis, batches),
           *client_violations(records, faults, fleet), *usage_violations(redis, jobs),
           *rate_violations(redis, jobs, records, clock.wall_t0)]
    forever = keys_without_ttl(redis)
    if forever:
        out.append(Violation("key_ttl", f"{len(forever)} keys without a TTL: {', '.join(forever[:10])}"))
    try:
        found = queue_model_violations(redis)
    except Exception as e:  # the check is the queue model's own; its failure is reported, not fatal
        found = [("check", f"queue_violations() failed: {type(e).__name__}: {e}")]
    out += [Violation("queue_model", f"{inv}: {detail}") for inv, detail in found or []]
    stats = {"jobs": len(jobs), "jobs_known_to_clients": len(known),
             "queue_model_checked": found is not None,
             "lost": sum(1 for j in jobs.values() if j.status is None),
             "duplicated_finals": sum(1 for j in jobs.values() if len(j.finals) > 1),
             "jobs_by_status": _count(str(j.status) for j in jobs.values()),
             "jobs_by_tenant": _count(j.tenant for j in jobs.values())}
    return out, stats


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))
