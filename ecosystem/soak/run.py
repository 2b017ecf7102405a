"""A soak run, phase by phase: start the fleet, run traffic and faults for the phase's duration
while the monitor samples, stop traffic, wait for the fleet to go quiet, probe that every
process serves, check every invariant, stop the fleet.

Phases: `main` (one redis-server with AOF, every fault kind but the failover) and, when the plan
asks, `sentinel` (a Sentinel-managed primary and replica; the failover and worker kills).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from ecosystem.soak.checks import Monitor, probe, process_violations, quiet_checks, wait_quiet
from ecosystem.soak.client import Clock, Record, send
from ecosystem.soak.faults import MAIN_KINDS, SENTINEL_KINDS, FaultRecord, Faults
from ecosystem.soak.fleet import RedisSide, SentinelRedis, SingleRedis, SoakFleet
from ecosystem.soak.plan import SoakPlan
from ecosystem.soak.traffic import BatchRef, Traffic
from ecosystem.soak.verdict import Violation


class Progress(Protocol):
    def phase(self, name: str, duration: float) -> None: ...

    def update(self, phase: PhaseRun) -> None: ...

    def log(self, message: str) -> None: ...


@dataclass
class PhaseResult:
    name: str
    duration: float
    records: list[Record] = field(default_factory=list)
    probes: list[Record] = field(default_factory=list)
    faults: list[FaultRecord] = field(default_factory=list)
    planned_faults: list[str] = field(default_factory=list)
    batches: list[BatchRef] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class SoakResult:
    plan: SoakPlan
    phases: list[PhaseResult]
    seconds: float

    @property
    def violations(self) -> list[Violation]:
        return [v for p in self.phases for v in p.violations]

    @property
    def ok(self) -> bool:
        return not self.violations


class PhaseRun:
    """One phase's live parts, for the progress display."""

    def __init__(self, name: str, duration: float, clock: Clock, traffic: Traffic, faults: Faults,
                 monitor: Monitor) -> None:
        self.name, self.duration, self.clock = name, duration, clock
        self.traffic, self.faults, self.monitor = traffic, faults, monitor
        self.stage = "starting"


def run_soak(plan: SoakPlan, progress: Progress) -> SoakResult:
    started = time.monotonic()
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    phases = [run_phase(plan, "main", SingleRedis, _kinds(plan, MAIN_KINDS), plan.duration, progress)]
    if plan.sentinel:
        phases.append(run_phase(plan, "sentinel", SentinelRedis, _kinds(plan, SENTINEL_KINDS),
                                plan.sentinel_duration, progress))
    return SoakResult(plan, phases, time.monotonic() - started)


def _kinds(plan: SoakPlan, phase_kinds: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(k for k in phase_kinds if not plan.faults or k in plan.faults)


def run_phase(plan: SoakPlan, name: str, redis_side: Callable[[Path], RedisSide], kinds: tuple[str, ...],
              duration: float, progress: Progress) -> PhaseResult:
    result = PhaseResult(name, duration)
    progress.phase(name, duration)
    t0 = time.monotonic()
    redis = redis_side(plan.run_dir / name / "redis")
    fleet = SoakFleet(plan, redis, name)
    try:
        progress.log(f"[{name}] starting {plan.workers} workers ({plan.backend}) and "
                     f"{plan.gateways} gateways")
        fleet.start()
        clock = Clock()
        traffic = Traffic(plan, fleet.gateway_url, lambda i: plan.client_deadline, redis.client, clock, name)
        monitor = Monitor(redis.client, clock)
        faults = Faults(fleet, traffic, clock, kinds, duration, plan.seed)
        run = PhaseRun(name, duration, clock, traffic, faults, monitor)
        result.planned_faults = [k for _, k in faults.planned]
        progress.log(f"[{name}] faults planned: {', '.join(result.planned_faults) or 'none'}")
        monitor.start()
        traffic.start()
        faults.start()
        run.stage = "traffic and faults"
        while clock.now() < duration:
            progress.update(run)
            time.sleep(0.5)
        run.stage = "finishing the last fault"
        while not faults.join(0.5):
            progress.update(run)
        run.stage = "stopping traffic"
        traffic.stop()
        still = traffic.join(plan.client_deadline + 15)
        if still:
            waiting = "client threads still waiting: " + ", ".join(still)
            result.violations.append(Violation("no_hang", waiting))
        run.stage = "waiting for the fleet to go quiet"
        progress.update(run)
        check = redis.client()
        result.violations += wait_quiet(check, traffic.batches, plan.quiet_timeout)
        monitor.stop()
        run.stage = "probing every gateway and worker"
        progress.update(run)
        probes, missing = probe(fleet, lambda gw, n: _probe(traffic, gw, n))
        result.probes = probes
        result.violations += missing
        result.violations += wait_quiet(check, [], 30)
        result.violations += process_violations(fleet)
        run.stage = "checking"
        progress.update(run)
        quiet, stats = quiet_checks(check, traffic.records, traffic.batches, faults.records, fleet, clock)
        result.violations += without_repeats(monitor.violations(), quiet) + quiet
        result.violations += fault_violations(result.planned_faults, faults.records)
        result.records, result.faults, result.batches = traffic.records, faults.records, traffic.batches
        stats["monitor_samples"] = monitor.limits.samples
        stats["restarts"] = {n: c - 1 for n, c in fleet.incarnations.count.items() if c > 1}
        stats["restarts_refused_name_taken"] = fleet.name_taken
        result.stats = stats
        progress.update(run)
    finally:
        with contextlib.suppress(Exception):
            fleet.close()
        result.seconds = time.monotonic() - t0
    return result


def _probe(traffic: Traffic, gateway: int, n: int) -> Record:
    """A short request after the run (not one of its records: the probes are judged apart)."""
    call = traffic.kinds.chat(random.Random(n), "default" if n % 2 else "search", kind="probe")
    call.priority = "high"
    record = Record(-n - 1, -1, call.kind, call.tenant, gateway, call.priority, False, traffic.clock.now())
    with httpx.Client() as http:
        return send(http, traffic.urls(gateway), call, record, traffic.clock, traffic.deadlines(gateway))


def without_repeats(seen: list[Violation], quiet: list[Violation]) -> list[Violation]:
    """What the monitor saw, less what the quiet checks report again (one problem, one line)."""
    later = {(v.invariant, v.detail) for v in quiet}
    return [v for v in seen if (v.invariant, v.detail.rsplit(" (lasted", 1)[0]) not in later]


def fault_violations(planned: list[str], done: list[FaultRecord]) -> list[Violation]:
    out = []
    ran = [f.kind for f in done]
    for kind in sorted(set(planned)):
        if ran.count(kind) < planned.count(kind):
            out.append(Violation("faults_ran", f"{kind}: {ran.count(kind)} of {planned.count(kind)} ran"))
    for f in done:
        if f.error:
            out.append(Violation("faults_ran", f"{f.kind} on {f.target}: {f.error}", f.started))
    return out
