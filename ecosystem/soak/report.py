"""What a soak run shows: a live rich display while it runs, the JSON file, and the readable
report at the end (requests by kind and outcome, faults by kind, violations by invariant, jobs
lost, duplicated finals, hung streams, the longest a client waited through each kind of fault)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ecosystem.soak.client import OUTCOMES, Record
from ecosystem.soak.faults import FaultRecord
from ecosystem.soak.run import PhaseResult, PhaseRun, SoakResult
from ecosystem.soak.verdict import INVARIANTS


class RichProgress:
    """A live panel: the phase's clock, requests by outcome, faults, what the monitor saw."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.live: Live | None = None

    def phase(self, name: str, duration: float) -> None:
        self.close()
        self.console.rule(f"soak phase [bold]{name}[/bold]: {duration:.0f}s of traffic and faults")
        self.live = Live(Text("starting the fleet ..."), console=self.console, refresh_per_second=2,
                         transient=False)
        self.live.start()

    def log(self, message: str) -> None:
        self.console.log(message)

    def update(self, run: PhaseRun) -> None:
        if self.live is None:
            return
        now = run.clock.now()
        outcomes = Counter(r.outcome or "running" for r in list(run.traffic.records))
        done = list(run.faults.records)
        current = run.faults.current
        head = Text.assemble((f"{run.name} ", "bold"), f"{min(now, run.duration):.0f}/{run.duration:.0f}s  ",
                             (run.stage, "cyan"))
        table = Table(box=None, show_header=False, pad_edge=False)
        table.add_row("requests", f"{sum(outcomes.values())}: " + ", ".join(
            f"{k} {v}" for k, v in sorted(outcomes.items(), key=lambda kv: -kv[1])))
        table.add_row("faults", f"{len(done)}/{len(run.faults.planned)} done"
                      + (f"; now {current.kind} on {current.target or '...'}" if current else "")
                      + ("; " + ", ".join(f"{f.kind}: {f.error}" for f in done if f.error) if any(
                          f.error for f in done) else ""))
        seen = run.monitor.violations()
        table.add_row("monitor", f"{run.monitor.limits.samples} samples, {len(seen)} violations so far"
                      + (f": {seen[0]}" if seen else ""))
        self.live.update(Group(head, table))

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


class QuietProgress:
    """For tests and scripts: log lines only."""

    def __init__(self, log: list[str] | None = None) -> None:
        self.lines = log if log is not None else []

    def phase(self, name: str, duration: float) -> None:
        self.lines.append(f"phase {name} ({duration:.0f}s)")

    def update(self, run: PhaseRun) -> None:
        pass

    def log(self, message: str) -> None:
        self.lines.append(message)


# -- figures ---------------------------------------------------------------------------------------


def longest_waits(records: list[Record], faults: list[FaultRecord]) -> dict[str, dict[str, Any]]:
    """Per fault kind: the longest a client went without a byte while that fault was on (a
    stream's longest gap between chunks; a plain request's wait for its answer), among requests
    that ended with an answer."""
    out: dict[str, dict[str, Any]] = {}
    for f in faults:
        hit = [r for r in records if r.started <= f.down_until and r.ended >= f.started
               and r.outcome in ("ok", "error_event", "refused")]
        if not hit:
            continue
        worst = max(hit, key=lambda r: r.longest_gap)
        best = out.get(f.kind)
        if best is None or worst.longest_gap > best["seconds"]:
            out[f.kind] = {"seconds": round(worst.longest_gap, 2), "request": worst.id, "kind": worst.kind,
                           "tenant": worst.tenant, "fault_target": f.target}
    return out


def tenant_jobs_on_killed_workers(faults: list[FaultRecord]) -> list[dict[str, str]]:
    return [{"job": j, "tenant": t, "worker": f.target} for f in faults if f.kind == "worker_kill9"
            for j, t in (f.details.get("tenant_jobs_streaming") or {}).items()]


def queued_tenant_cancels(phase: PhaseResult) -> list[dict[str, Any]]:
    scenario = [c for f in phase.faults if f.kind == "queued_cancel"
                for c in f.details.get("cancelled_queued", [])]
    traffic = [{"job": r.job_ids[0], "tenant": r.tenant} for r in phase.records
               if r.kind == "cancel_early" and r.queued_when_left and r.tenant != "default" and r.job_ids]
    return scenario + traffic


def phase_summary(phase: PhaseResult) -> dict[str, Any]:
    by_kind: dict[str, Counter[str]] = {}
    for r in phase.records:
        by_kind.setdefault(r.kind, Counter())[r.outcome] += 1
    return {
        "name": phase.name, "duration": phase.duration, "seconds": round(phase.seconds, 1),
        "requests": {"total": len(phase.records),
                     "by_outcome": dict(Counter(r.outcome for r in phase.records)),
                     "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())}},
        "faults_planned": phase.planned_faults,
        "faults": [f.as_dict() for f in phase.faults],
        "faults_by_kind": dict(Counter(f.kind for f in phase.faults)),
        "tenant_jobs_on_killed_workers": tenant_jobs_on_killed_workers(phase.faults),
        "queued_tenant_jobs_cancelled": queued_tenant_cancels(phase),
        "longest_wait_through_fault": longest_waits(phase.records, phase.faults),
        "hung": [r.id for r in phase.records if r.outcome == "hung"],
        "batches": [{"id": b.id, "tenant": b.tenant, "lines": b.lines, "cancelled": b.cancelled}
                    for b in phase.batches],
        "probes": len(phase.probes),
        "stats": phase.stats,
        "violations": [v.as_dict() for v in phase.violations],
        "records": [r.as_dict() for r in phase.records],
    }


def summary(result: SoakResult) -> dict[str, Any]:
    return {"ok": result.ok, "seconds": round(result.seconds, 1), "plan": result.plan.as_dict(),
            "invariants": INVARIANTS,
            "violations": [{"phase": p.name, **v.as_dict()} for p in result.phases for v in p.violations],
            "phases": [phase_summary(p) for p in result.phases]}


def write_json(result: SoakResult, path: Path) -> dict[str, Any]:
    out = summary(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    return out


# -- the readable report ------------------------------------------------------------------------------


def render(result: SoakResult, console: Console) -> None:
    plan = result.plan
    console.rule("soak report")
    console.print(f"seed {plan.seed}, backend {plan.backend}, {plan.workers} workers, {plan.gateways} "
                  f"gateways, {plan.clients} clients; {result.seconds:.0f}s in all; "
                  f"run directory {plan.run_dir}")
    for phase in result.phases:
        s = phase_summary(phase)
        console.print(Text(f"\nphase {phase.name}: {phase.duration:.0f}s of traffic, "
                           f"{phase.seconds:.0f}s in all", style="bold"))
        console.print(_requests_table(s["requests"]["by_kind"]))
        console.print(_faults_table(phase.faults, s["longest_wait_through_fault"]))
        stats = s["stats"]
        console.print(f"jobs in Redis: {stats.get('jobs', '?')} ({stats.get('jobs_by_status', {})}); "
                      f"lost: {stats.get('lost', '?')}; "
                      f"duplicated finals: {stats.get('duplicated_finals', '?')}; "
                      f"hung streams: {len(s['hung'])}; batches: {len(s['batches'])}; probes: {s['probes']}")
        checked = "ran" if stats.get("queue_model_checked") else "not available"
        console.print(f"named-tenant jobs streaming on killed workers: "
                      f"{len(s['tenant_jobs_on_killed_workers'])}; named-tenant jobs cancelled while queued: "
                      f"{len(s['queued_tenant_jobs_cancelled'])}; queue-model check: {checked}")
    violations = result.violations
    if not violations:
        console.print(Text("\nno invariant violated", style="bold green"))
        return
    console.print(Text(f"\n{len(violations)} violations", style="bold red"))
    grouped: dict[str, list[str]] = {}
    for p in result.phases:
        for v in p.violations:
            grouped.setdefault(v.invariant, []).append(f"[{p.name}] {v.detail}"
                                                       + (f" (at {v.at:.1f}s)" if v.at is not None else ""))
    for invariant, details in grouped.items():
        console.print(Text(f"{invariant}: {INVARIANTS.get(invariant, '')}", style="bold"))
        for d in details[:15]:
            console.print(f"  - {d}", markup=False, highlight=False)
        if len(details) > 15:
            console.print(f"  ... and {len(details) - 15} more (the JSON has them all)")


def _requests_table(by_kind: dict[str, dict[str, int]]) -> Table:
    present = [o for o in (*OUTCOMES, "soak_error") if any(o in v for v in by_kind.values())]
    table = Table(title="requests by kind and outcome", title_justify="left")
    table.add_column("kind")
    for o in present:
        table.add_column(o, justify="right")
    table.add_column("total", justify="right")
    for kind, counts in by_kind.items():
        table.add_row(kind, *(str(counts.get(o, "")) for o in present), str(sum(counts.values())))
    return table


def _faults_table(faults: list[FaultRecord], waits: dict[str, dict[str, Any]]) -> Table:
    table = Table(title="faults by kind", title_justify="left")
    for col in ("kind", "count", "targets", "recovered in (s)", "longest client wait (s)", "errors"):
        table.add_column(col)
    kinds: dict[str, list[FaultRecord]] = {}
    for f in faults:
        kinds.setdefault(f.kind, []).append(f)
    for kind, fs in kinds.items():
        recovered = ", ".join(f"{f.down_until - f.started:.1f}" for f in fs)
        wait = waits.get(kind, {}).get("seconds", "")
        errors = "; ".join(f.error for f in fs if f.error)
        targets = ", ".join(sorted({f.target for f in fs}))
        table.add_row(kind, str(len(fs)), targets, recovered, str(wait), errors)
    return table
