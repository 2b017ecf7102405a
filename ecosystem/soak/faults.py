"""Fault injection at seeded times: the schedule is a function of the seed, each fault runs to
its recovery (the process back and serving) before the next one starts, and each is recorded
with its window, its target and what it hit.

Kinds (phase `main`, one Redis behind per-worker link proxies):

- `worker_kill9`: kill -9 of a worker while a named tenant's job streams on it (the scenario
  starts one if traffic has none there), then a restart under the same name;
- `worker_drain`: SIGTERM (drain: running jobs past `drain_grace` are handed back), wait for the
  exit, restart;
- `gateway_kill9`: kill -9 of a gateway, restart on the same port;
- `redis_restart`: redis-server killed (kill -9 or SIGTERM, seeded) and started again from its
  AOF on the same port and directory;
- `link_cut`: a worker's link to Redis cut for longer than its heartbeat TTL, then restored;
- `queued_cancel`: every worker paused (SIGSTOP, shorter than the heartbeat TTL) while a named
  tenant's streamed request arrives, its client leaves while the job is queued (confirmed in
  Redis), then the workers go on: the cancel of a queued tenant job, every time.

Phase `sentinel`: `sentinel_failover` (kill -9 of the primary; the Sentinels promote the
replica; the old primary comes back as a replica, with its AOF), and `worker_kill9`.
"""

from __future__ import annotations

import contextlib
import functools
import random
import signal
import threading
from dataclasses import dataclass, field
from typing import Any

from backends.contract.keys import job_key, worker_key
from backends.contract.replies import as_str
from ecosystem.local.processes import wait_for
from ecosystem.soak.client import Clock
from ecosystem.soak.fleet import SentinelRedis, SingleRedis, SoakFleet
from ecosystem.soak.state import held, held_tenant_jobs
from ecosystem.soak.traffic import Traffic

MAIN_KINDS = ("worker_kill9", "queued_cancel", "worker_drain", "gateway_kill9", "redis_restart", "link_cut")
SENTINEL_KINDS = ("sentinel_failover", "worker_kill9")
KINDS = (*MAIN_KINDS, "sentinel_failover")
PROBE_TENANTS = ("search", "bots", "trial")  # named tenants whose jobs run at default priority


@dataclass
class FaultRecord:
    kind: str
    target: str
    started: float
    ended: float = 0.0
    down_until: float = 0.0  # when the target was back (serving again)
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "target": self.target, "started": round(self.started, 2),
                "ended": round(self.ended, 2), "down_until": round(self.down_until, 2),
                "details": self.details, "error": self.error}


class Faults:
    def __init__(self, fleet: SoakFleet, traffic: Traffic, clock: Clock, kinds: tuple[str, ...],
                 duration: float, seed: int) -> None:
        self.fleet = fleet
        self.traffic = traffic
        self.clock = clock
        self.kinds = kinds
        self.duration = duration
        self.rng = random.Random(f"{seed}:{fleet.phase}:faults")
        self.planned = self._schedule(random.Random(f"{seed}:{fleet.phase}:schedule"))
        self.records: list[FaultRecord] = []
        self.current: FaultRecord | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="soak-faults")
        self._probes = 0

    # -- the schedule ----------------------------------------------------------------------------------

    def _schedule(self, rng: random.Random) -> list[tuple[float, str]]:
        """(start time, kind): every kind once per round, rounds in a seeded order, spread over
        the phase; the first after a warm-up, the last early enough to recover before it ends."""
        lead, tail = min(8.0, self.duration * 0.1), min(25.0, self.duration * 0.2)
        span = max(1.0, self.duration - lead - tail)
        slot = 30.0 if self.duration < 600 else 75.0  # seconds one fault and its recovery may take
        rounds = max(1, int(span // (slot * len(self.kinds))))
        kinds = []
        for _ in range(rounds):
            order = list(self.kinds)
            rng.shuffle(order)
            kinds += order
        if not kinds:
            return []
        step = span / len(kinds)
        return [(lead + i * step + rng.uniform(0, step * 0.3), kind) for i, kind in enumerate(kinds)]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        for at, kind in self.planned:
            if self._stop.wait(max(0.0, at - self.clock.now())):
                return
            record = FaultRecord(kind, "", self.clock.now())
            self.current = record
            try:
                getattr(self, kind)(record)
            except Exception as e:  # the soak goes on; the checks find what the failure left
                record.error = f"{type(e).__name__}: {e}"
            record.ended = self.clock.now()
            record.down_until = record.down_until or record.ended
            self.records.append(record)
            self.current = None

    # -- helpers ---------------------------------------------------------------------------------------

    def _redis(self) -> Any:
        return self.fleet.redis.client()

    def _live_workers(self) -> list[str]:
        return [n for n, w in self.fleet.workers.items() if w.alive()]

    def _probe_tenant(self) -> str:
        self._probes += 1
        return PROBE_TENANTS[self._probes % len(PROBE_TENANTS)]

    def _tenant_job_running(self, timeout: float) -> tuple[str, dict[str, str]] | None:
        """A live worker holding a named tenant's job that is mid-stream, and those jobs; a long
        streamed job of a named tenant is sent first when no worker holds one."""
        r = self._redis()

        def look() -> tuple[str, dict[str, str]] | None:
            candidates = []
            for name in self._live_workers():
                with contextlib.suppress(Exception):
                    jobs = held_tenant_jobs(r, name)
                    if jobs:
                        candidates.append((len(jobs), name, jobs))
            if not candidates:
                return None
            _, name, jobs = max(candidates)
            return name, jobs

        found = look()
        if found is not None:
            return found
        for _ in range(2):  # two long jobs: the first may be refused by its tenant's limits
            call = self.traffic.kinds.long_stream(self.rng, self._probe_tenant(), kind="fault_probe")
            call.priority = "high"
            self.traffic.spawn(call, 0)
        try:
            return wait_for(look, timeout, "a named tenant's job streaming on a worker", interval=0.1)
        except TimeoutError:
            return None

    def _restart_worker(self, record: FaultRecord, name: str) -> None:
        t0 = self.clock.now()
        self.fleet.start_worker(name)
        record.details["restart_s"] = round(self.clock.now() - t0, 2)
        record.down_until = self.clock.now()

    # -- the kinds --------------------------------------------------------------------------------------

    def worker_kill9(self, record: FaultRecord) -> None:
        found = self._tenant_job_running(timeout=30)
        if found is None:
            victim = self.rng.choice(self._live_workers())
            tenant_jobs: dict[str, str] = {}
        else:
            victim, tenant_jobs = found
        record.target = victim
        with contextlib.suppress(Exception):
            record.details["held"] = held(self._redis(), victim)
        record.details["tenant_jobs_streaming"] = tenant_jobs
        self.fleet.kill_worker(victim, signal.SIGKILL)
        record.details["killed_at"] = round(self.clock.now(), 2)
        self._stop.wait(self.rng.uniform(1.0, 3.0))
        self._restart_worker(record, victim)

    def worker_drain(self, record: FaultRecord) -> None:
        workers = self._live_workers()
        r = self._redis()
        busiest = max(workers, key=lambda n: (len(held(r, n)), self.rng.random()))
        record.target = busiest
        record.details["held"] = held(r, busiest)
        code = self.fleet.kill_worker(busiest, signal.SIGTERM, timeout=self.fleet.plan.drain_grace + 60)
        record.details["exit_code"] = code
        if code != 0:
            record.error = f"worker {busiest} exited {code} on SIGTERM (a drain exits 0)"
        self._stop.wait(self.rng.uniform(0.5, 2.0))
        self._restart_worker(record, busiest)

    def gateway_kill9(self, record: FaultRecord) -> None:
        index = self.rng.randrange(len(self.fleet.gateways))
        record.target = self.fleet.gateway_name(index)
        self.fleet.kill_gateway(index)
        self._stop.wait(self.rng.uniform(0.5, 2.0))
        t0 = self.clock.now()
        self.fleet.start_gateway(index)
        self.fleet.wait_healthy(index)
        record.details["restart_s"] = round(self.clock.now() - t0, 2)
        record.down_until = self.clock.now()

    def redis_restart(self, record: FaultRecord) -> None:
        redis = self.fleet.redis
        assert isinstance(redis, SingleRedis)
        sig = self.rng.choice((signal.SIGKILL, signal.SIGTERM))
        down = self.rng.uniform(1.0, 3.0)
        record.target = "redis-server"
        record.details.update(signal=signal.Signals(sig).name, down_s=round(down, 2))
        redis.restart(sig, down)
        record.down_until = self.clock.now()
        for i in range(len(self.fleet.gateways)):
            self.fleet.wait_healthy(i, timeout=60)
        record.details["healthy_after_s"] = round(self.clock.now() - record.down_until, 2)

    def link_cut(self, record: FaultRecord) -> None:
        redis = self.fleet.redis
        assert isinstance(redis, SingleRedis)
        r = self._redis()
        workers = self._live_workers()
        victim = max(workers, key=lambda n: (len(held_tenant_jobs(r, n, streaming_only=False)),
                                             len(held(r, n)), self.rng.random()))
        record.target = victim
        record.details["held"] = held(r, victim)
        cut_for = self.fleet.plan.heartbeat_ttl + self.rng.uniform(2.0, 4.0)
        record.details["cut_s"] = round(cut_for, 2)
        proxy = redis.proxies[victim]
        proxy.cut()
        try:
            self._stop.wait(cut_for)
            record.details["reaped"] = not r.exists(worker_key(victim))
        finally:
            proxy.restore()
        restored = self.clock.now()
        wait_for(lambda: r.exists(worker_key(victim)), 90, f"worker {victim} to register again", interval=0.2)
        record.details["rejoined_after_s"] = round(self.clock.now() - restored, 2)
        record.down_until = self.clock.now()

    def queued_cancel(self, record: FaultRecord) -> None:
        paused = self._live_workers()
        record.target = ",".join(paused)
        r = self._redis()
        cancelled: list[dict[str, Any]] = []
        self.fleet.pause_workers(paused)
        try:
            for _ in range(3):  # a tenant at its limit answers 429: the next one is asked
                tenant = self._probe_tenant()
                call = self.traffic.kinds.long_stream(self.rng, tenant, kind="cancel_queued",
                                                      leave="after_headers")
                sent, thread = self.traffic.spawn(call, self.rng.randrange(len(self.fleet.gateways)))
                thread.join(10)
                if sent.queued_when_left and sent.job_ids:
                    job = sent.job_ids[0]
                    # the gateway cancels once it sees the client gone: wait for that before the
                    # workers run again, so the cancel meets a queued job
                    with contextlib.suppress(TimeoutError):
                        wait_for(functools.partial(_status_is, r, job, "canceled"), 1.0,
                                 "the gateway to cancel the queued job", interval=0.02)
                    cancelled.append({"job": job, "tenant": tenant,
                                      "status": as_str(r.hget(job_key(job), "status"))})
                    break
        finally:
            self.fleet.resume_workers(paused)
        record.details["cancelled_queued"] = cancelled
        if not cancelled:
            record.error = "no named tenant's job could be cancelled while queued"

    def sentinel_failover(self, record: FaultRecord) -> None:
        """The primary killed; the Sentinels promote the replica; the old one comes back (with
        its AOF) as a replica, as its supervisor would restart it."""
        redis = self.fleet.redis
        assert isinstance(redis, SentinelRedis)
        cluster = redis.cluster
        old = cluster.kill_primary()
        record.target = f"redis-server:{old}"
        killed = self.clock.now()

        def promoted() -> bool:
            with contextlib.suppress(Exception):
                return int(cluster.primary_port()) != old
            return False

        wait_for(promoted, 60, "the Sentinels to promote the replica", interval=0.2)
        record.details["promoted_after_s"] = round(self.clock.now() - killed, 2)
        self._stop.wait(self.rng.uniform(1.0, 3.0))
        cluster.restart(old)
        record.down_until = self.clock.now()
        for i in range(len(self.fleet.gateways)):
            self.fleet.wait_healthy(i, timeout=90)


def _status_is(redis: Any, job_id: str, status: str) -> bool:
    return as_str(redis.hget(job_key(job_id), "status")) == status
