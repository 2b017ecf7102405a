"""The heartbeat thread: every `heartbeat_interval` seconds, refresh the worker's status hash
(TTL = 3 intervals: its expiry is how others learn the worker died), RQ's worker heartbeat and
the RQ executions of in-flight jobs. When jobs end it beats early, so `fleet status` counts them
at once. Every 2 intervals a second thread reaps dead workers' jobs.

Threads, not the loop, so a long decode step never starves liveness (llama_decode and socket
reads release the GIL); and two threads, so a slow reap (a busy Redis, many jobs to hand back)
never delays a beat: a healthy worker must not look dead because a reap took long.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import psutil
from redis import Redis

from backends.contract.keys import WORKERS_SET, executions_key, model_card_key, worker_key
from backends.contract.lua import lua_script, queue_script
from backends.contract.redact import redact_url
from backends.contract.replies import Fields
from backends.contract.retry import OUTAGE_ERRORS
from worker.health import write_health
from worker.hooks import facts

if TYPE_CHECKING:
    from rq.worker import Worker

    from worker.liveness.reaper import Reaper
    from worker.serving.loop import FleetWorker

log = logging.getLogger("fleet.heartbeat")

# Refreshes an RQ execution only while it exists (why, KEYS and ARGV: the script's header).
_REFRESH_EXECUTION = lua_script("worker.liveness", "refresh_execution.lua")
REAP_EVERY = 2  # heartbeat intervals
EARLY_BEAT_GAP = 0.2  # seconds


class Heartbeat(threading.Thread):
    def __init__(self, fleet_worker: FleetWorker, rq_worker: Worker, reaper: Reaper,
                 static: dict[str, Any], model_card: dict[str, Any] | None = None) -> None:
        super().__init__(name="fleet-heartbeat", daemon=True)
        self.fw = fleet_worker
        # the model card, encoded once; written with each beat so it lives exactly as the status does
        self.card = json.dumps(model_card, separators=(",", ":")) if model_card else None
        self.rq_worker = rq_worker
        self.reaper = reaper
        self.static = static  # host, pid, cpus, numa, backend, slots, ...
        self.interval = fleet_worker.settings.heartbeat_interval
        self.ttl_ms = int(self.interval * 3000)
        self.proc = psutil.Process()
        self.proc.cpu_percent()  # first call primes the counter
        self._halt = threading.Event()
        self.beats = 0
        self.reaping = threading.Thread(target=self._reap_loop, name="fleet-reaper", daemon=True)
        self.facts = facts.LiveFacts(fleet_worker.settings.pool, fleet_worker.name,
                                     counting=fleet_worker.settings.observe)

    def start(self) -> None:
        super().start()
        self.reaping.start()

    def publish_card(self, model_card: dict[str, Any]) -> None:
        """A new model card (one that learnt its file's digest), written from the next beat on."""
        self.card = json.dumps(model_card, separators=(",", ":"))

    def halt(self) -> None:
        self._halt.set()
        self.fw.jobs_ended.set()  # cut the wait short

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.reaping.is_alive():
            self.reaping.join(timeout)

    def run(self) -> None:
        link = self.fw.link
        while not self._halt.is_set():
            self._write_health()
            try:
                self.beat()
                link.succeeded()
            except OUTAGE_ERRORS as e:  # Redis away: beat again next interval (link logs, rate-limited)
                link.failed(e, "heartbeating")
            except Exception:
                log.exception("heartbeat error")
            self._wait()

    def _reap_loop(self) -> None:
        while not self._halt.wait(REAP_EVERY * self.interval):
            try:
                self.reaper.reap()
            except OUTAGE_ERRORS:
                pass  # the heartbeat reports the outage; reap again next period
            except Exception:
                log.exception("reaper error")

    def _write_health(self) -> None:
        """The local health file for `fleet health` (worker/health.py): written whether Redis
        answers or not, so liveness never depends on Redis."""
        path = self.fw.settings.health_file
        if path is not None:
            try:
                write_health(path, self.fw)
            except OSError as e:
                log.warning("cannot write health file %s: %s", path, e)

    def _wait(self) -> None:
        """Until the next beat, or sooner when jobs ended, so that `fleet status` shows them at
        once (at most one early beat per EARLY_BEAT_GAP)."""
        if self.fw.jobs_ended.wait(self.interval):
            self.fw.jobs_ended.clear()
            self._halt.wait(EARLY_BEAT_GAP)

    def status(self) -> dict[str, Any]:
        fw = self.fw
        mem = self.proc.memory_info()
        stats = fw.backend.stats()
        return {
            **self.static,
            "state": fw.counters.state,
            "inflight": len(fw.inflight),
            "jobs_done": fw.counters.jobs_done,
            "jobs_failed": fw.counters.jobs_failed,
            "jobs_requeued": fw.counters.jobs_requeued,
            "redis_outages": fw.link.outages,
            "tokens": fw.counters.tokens,
            "tok_s": round(fw.counters.tokens_per_second(), 1),
            "rss_mb": round(mem.rss / 2**20, 1),
            "cpu_pct": round(self.proc.cpu_percent(), 1),
            "backend_stats": redact(stats),
            "cannot_hold": fw.claims.cannot_hold,  # catalogue models too big for this worker, by pool
            # the loop's jobs copied in one C-level call; the engine hold is safe to read here
            **self.facts.status_fields(stats, list(fw.inflight.values()), fw.engine_hold.down),
            "updated_at": round(time.time(), 3),
        }

    def beat(self) -> None:
        self.beats += 1
        fw = self.fw
        status: Fields = {k: json.dumps(v) for k, v in self.status().items()}
        ttl_s = max(int(fw.settings.silent_for_dead), 3)
        with fw.redis.pipeline(transaction=False) as pipe:
            pipe.exists(self.rq_worker.key)  # before RQ's heartbeat, which would recreate it
            pipe.hset(worker_key(fw.name), mapping=status)
            pipe.pexpire(worker_key(fw.name), self.ttl_ms)
            if self.card is not None:
                pipe.set(model_card_key(fw.name), self.card, px=self.ttl_ms)
            pipe.sadd(WORKERS_SET, fw.name)
            fw.claims.refresh(pipe)  # records the claims keep alive (the models a worker holds)
            self.facts.on_beat(pipe)
            self.rq_worker.heartbeat(timeout=ttl_s + 60, pipeline=pipe)
            ttl = fw.settings.job_timeout + 60
            for job in list(fw.inflight.values()):
                if job.execution is not None and job.job is not None:
                    execution = job.execution
                    keys = [execution.key, job.job.started_job_registry.key, executions_key(job.id)]
                    args = [time.time(), ttl, execution.composite_key, execution.id]
                    queue_script(pipe, _REFRESH_EXECUTION, keys, args)
            rq_registered = pipe.execute()[0]
        if not rq_registered:  # lost with a Redis that restarted empty, or reaped while we were cut off
            fw.redis.delete(self.rq_worker.key)
            self.rq_worker.register_birth()
            log.warning("re-registered %s with RQ", fw.name)


def redact(value: Any) -> Any:
    """Backend stats as shown in `fleet status`: URLs (endpoints) without their credentials."""
    if isinstance(value, dict):
        return {k: redact(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v) for v in value]
    if isinstance(value, str) and "://" in value and "@" in value:
        return redact_url(value)
    return value


def static_status(name: str, settings: Any, backend_name: str, slots: int,
                  pin: dict[str, Any], model: str = "", thinks: bool = False,
                  pools: list[str] | None = None) -> dict[str, Any]:
    """What the status hash says for the worker's life; `model`: its model's Ollama-style name
    (the card's `name`: the gateway lists the pool's model under it); `thinks`: its template
    thinks (the gateway asks such a pool for thoughts apart by default); `pools`: every pool it
    claims from (a catalogue worker's: one per model it may load; `pool` is the first)."""
    pools = pools or [settings.pool]
    return {
        "name": name,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pool": pools[0],
        "pools": pools,
        "model": model,
        "thinks": thinks,
        "backend": backend_name,
        "slots": slots,
        "started_at": round(time.time(), 3),
        **pin,
    }


def clear_status(redis: Redis, name: str) -> None:
    with redis.pipeline(transaction=False) as pipe:
        pipe.delete(worker_key(name), model_card_key(name))
        pipe.srem(WORKERS_SET, name)
        pipe.execute()
