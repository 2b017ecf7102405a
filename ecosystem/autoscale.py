"""Scale from zero under `fleet up --scale-from-zero`: the planned workers start stopped, and a
small program beside them (`fleet autoscale`, run by the same supervisord) starts one when a
catalogue model's queue has jobs and no running worker serves it, and stops a worker that has
held no model and run no job for `idle_stop` seconds (its models went after their keep_alive),
as KEDA does in Kubernetes from the same signal: the queue's depth.

Policy (`decide`) is plain data in, names out; the loop (`Autoscaler`) reads Redis and talks to
supervisord's XML-RPC interface.
"""

from __future__ import annotations

import logging
import time
import xmlrpc.client
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from redis import Redis

from backends.contract.keys import fair_key, queue_key, queue_names
from dispatcher import status as fleet_status
from ecosystem.render import UNIT_PREFIX

log = logging.getLogger("fleet.autoscale")
STARTING = {"STARTING", "RUNNING", "BACKOFF"}  # supervisord states of a program on its way up or up
STOPPED = {"STOPPED", "EXITED", "FATAL"}


@dataclass
class Worker:
    """What the policy needs of one live worker (its status hash)."""

    pools: list[str]
    inflight: int
    models: int  # catalogue models it holds loaded


@dataclass
class Decision:
    start: list[str] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)


def decide(programs: Mapping[str, str], live: Mapping[str, Worker], queued: Iterable[str],
           idle_since: dict[str, float], now: float, idle_stop: float) -> Decision:
    """`programs`: worker program -> supervisord state; `live`: program -> its status (registered
    workers); `queued`: pools with jobs waiting. `idle_since` is the policy's own memory (when each
    running worker was first seen idle), updated here."""
    out = Decision()
    waiting = set(queued)
    up = [name for name, state in programs.items() if state in STARTING]
    # a running program that has not registered yet may serve any pool: wait for it
    serving = {pool for name in up for pool in (live[name].pools if name in live else waiting)}
    stopped = sorted(name for name, state in programs.items() if state in STOPPED)
    if waiting - serving and stopped:  # one worker at a time: each serves every catalogue model
        out.start.append(stopped[0])
    for name in up:
        worker = live.get(name)
        if worker is None or worker.inflight or worker.models or waiting & set(worker.pools):
            idle_since.pop(name, None)
            continue
        since = idle_since.setdefault(name, now)
        if now - since >= idle_stop:
            out.stop.append(name)
            idle_since.pop(name, None)
    return out


class Autoscaler:
    def __init__(self, redis: Redis, supervisor: Any, pools: list[str], idle_stop: float) -> None:
        self.redis, self.supervisor, self.pools, self.idle_stop = redis, supervisor, pools, idle_stop
        self.idle_since: dict[str, float] = {}

    def queued(self) -> set[str]:
        """The pools with a job waiting (their own queues or a tenant's)."""
        with self.redis.pipeline(transaction=False) as pipe:
            for pool in self.pools:
                for queue in queue_names(pool):
                    pipe.llen(queue_key(queue))
                    pipe.zcard(fair_key(queue))
            counts = pipe.execute()
        per = 2 * len(queue_names(self.pools[0])) if self.pools else 0
        return {pool for i, pool in enumerate(self.pools) if any(counts[i * per:(i + 1) * per])}

    def once(self) -> Decision:
        infos = self.supervisor.supervisor.getAllProcessInfo()
        # the worker programs: the fleet's group (services have groups of their own)
        programs = {i["name"]: i["statename"] for i in infos if i.get("group") == UNIT_PREFIX}
        live = {str(w["name"]): Worker(list(w.get("pools") or [w.get("pool")]), int(w.get("inflight") or 0),
                                       len((w.get("backend_stats") or {}).get("models") or []))
                for w in fleet_status.workers(self.redis)}
        decision = decide(programs, live, self.queued(), self.idle_since, time.monotonic(), self.idle_stop)
        for name in decision.start:
            log.info("starting %s: a model's queue has jobs and no running worker serves it", name)
            self._call("startProcess", name)
        for name in decision.stop:
            log.info("stopping %s: no model loaded and no job for %.0fs", name, self.idle_stop)
            self._call("stopProcess", name)
        return decision

    def _call(self, method: str, name: str) -> None:
        try:
            getattr(self.supervisor.supervisor, method)(f"{UNIT_PREFIX}:{name}", False)
        except xmlrpc.client.Fault as e:  # already started / stopped meanwhile
            log.info("%s %s: %s", method, name, e.faultString)

    def run(self, interval: float) -> None:
        while True:
            try:
                self.once()
            except Exception:  # Redis or supervisord away for a moment: look again
                log.exception("autoscale pass failed")
            time.sleep(interval)
