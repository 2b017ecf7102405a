"""A chain of backends, [primary, *fallbacks]: jobs go to the first healthy one; when a backend is
unreachable or fails a job for its own reasons (Failed.retryable), the job runs again on the next
backend of the chain that has not tried it, and the failed backend rests (exponential backoff,
1 s .. 30 s) until a probe says it answers again.

Health is per backend, not per job: one transport failure marks a backend unhealthy, and it gets
new jobs again only after its backoff and a successful `probe()` (part of the Backend protocol).
Consecutive failures double the backoff; a job finished on the backend resets it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from backends.base import Backend, BackendUnavailable, Done, Event, Failed, Restarted, Token
from backends.contract.retry import Backoff
from backends.contract.schema import GenerateRequest

BACKOFF_FIRST = 1.0
BACKOFF_MAX = 30.0
POLL_SLICE = 0.01  # when several backends have jobs, each is drained in turn this often
_REST = Backoff(BACKOFF_FIRST, BACKOFF_MAX)


def backoff_delay(failures: int) -> float:
    """1 s after the first failure, doubling, at most 30 s."""
    return _REST.delay(failures)


@dataclass
class Member:
    """One backend of the chain and what the chain knows of its health."""

    label: str
    build: Callable[[], Backend]
    backend: Backend | None = None
    healthy: bool = False
    failures: int = 0  # consecutive; reset by a job that finishes here
    retry_at: float = 0.0  # not probed before this (monotonic clock)
    probing: bool = False
    last_error: str = ""
    jobs: set[str] = field(default_factory=set)


@dataclass
class Route:
    """Where one job runs, and where it has already failed."""

    job_id: str
    request: GenerateRequest
    member: Member | None = None
    tried: list[Member] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    tokens: int = 0  # tokens the worker has seen from the current attempt


class FallbackBackend:
    """`name` is the chain's backend types, e.g. 'llama-server>llama-cpp' (what `fleet status` shows);
    each Done carries the name of the backend that served it in `extra["backend"]` (what the result
    records)."""

    def __init__(
        self,
        members: Sequence[tuple[str, Callable[[], Backend]]],
        *,
        name: str = "fallback",
        clock: Callable[[], float] = time.monotonic,
        background_probes: bool = True,
    ) -> None:
        if not members:
            raise ValueError("a fallback chain needs at least one backend")
        self.name = name
        self.members = [Member(label, build) for label, build in members]
        self.clock = clock
        self.background_probes = background_probes  # False: probe inside step() (deterministic tests)
        self._lock = threading.Lock()
        self._routes: dict[str, Route] = {}
        self._pending: list[Route] = []  # failed over, waiting for a free slot on the next backend
        self._ready: list[Event] = []  # events made outside a member's step (cancel while pending)
        for m in self.members:
            self._try_build(m)
        if not any(m.healthy for m in self.members):
            raise BackendUnavailable("no backend of the chain is reachable: " + self._errors())
        self.slots = max(m.backend.slots for m in self.members if m.backend is not None)

    # -- health -------------------------------------------------------------------------------------

    def _try_build(self, m: Member) -> None:
        try:
            m.backend = m.build()
            m.healthy, m.last_error = True, ""
        except BackendUnavailable as e:
            self._mark_unhealthy(m, str(e))

    def _mark_unhealthy(self, m: Member, error: str) -> None:
        m.last_error = error
        if m.healthy or m.failures == 0:  # one outage counts once, however many jobs it failed
            m.failures += 1
            m.retry_at = self.clock() + backoff_delay(m.failures)
        m.healthy = False

    def _probe(self, m: Member) -> None:
        """Build the backend if it never came up, else ask it; healthy again when it answers."""
        backend: Backend | None = m.backend
        try:
            if backend is None:
                backend = m.build()
                ok, error = True, ""
            else:
                ok = bool(backend.probe())
                error = "" if ok else "probe failed"
        except Exception as e:  # a probe must never take the worker down
            ok, error = False, f"{type(e).__name__}: {e}"
        with self._lock:
            m.probing = False
            m.backend = backend
            if ok:
                m.healthy, m.last_error = True, ""
                self.slots = max(self.slots, backend.slots if backend else 0)
            else:
                m.failures += 1
                m.last_error = error or m.last_error
                m.retry_at = self.clock() + backoff_delay(m.failures)

    def _start_due_probes(self) -> None:
        now = self.clock()
        for m in self.members:
            if m.healthy or m.probing or now < m.retry_at:
                continue
            m.probing = True
            if self.background_probes:
                threading.Thread(target=self._probe, args=(m,), name=f"probe-{m.label}", daemon=True).start()
            else:
                self._probe(m)

    def _errors(self) -> str:
        return "; ".join(f"{m.label}: {m.last_error}" for m in self.members if m.last_error)

    # -- placement ----------------------------------------------------------------------------------

    def _first_healthy(self) -> Member | None:
        with self._lock:
            return next((m for m in self.members if m.healthy and m.backend is not None), None)

    def _place(self, route: Route) -> str:
        """Admit the job on the first healthy backend it has not tried: 'placed', 'wait' (the next
        one is full) or 'exhausted' (no backend left to try)."""
        for m in self.members:
            if m in route.tried:
                continue
            with self._lock:
                backend = m.backend if m.healthy else None
            if backend is None:
                continue
            if backend.free_slots() <= 0:
                return "wait"
            try:
                backend.admit(route.job_id, route.request)
            except BackendUnavailable as e:
                route.tried.append(m)
                route.errors.append(f"{m.label}: {e}")
                with self._lock:
                    self._mark_unhealthy(m, str(e))
                continue
            route.member = m
            m.jobs.add(route.job_id)
            return "placed"
        return "exhausted"

    # -- the Backend protocol -----------------------------------------------------------------------

    def probe(self) -> bool:
        """True when some backend of the chain is healthy now."""
        return self._first_healthy() is not None

    def free_slots(self) -> int:
        m = self._first_healthy()
        if m is None or m.backend is None:
            return 0  # nothing reachable: claim nothing; step() keeps probing
        return max(0, m.backend.free_slots() - len(self._pending))

    def admit(self, job_id: str, request: GenerateRequest) -> None:
        if job_id in self._routes:
            raise ValueError(f"job {job_id} is already running")
        route = Route(job_id, request)
        if self._place(route) != "placed":
            raise BackendUnavailable(
                f"no backend can take job {job_id}: " + ("; ".join(route.errors) or "all full")
            )
        self._routes[job_id] = route

    def step(self, timeout: float) -> list[Event]:
        self._start_due_probes()
        events, self._ready = self._ready, []
        events += self._place_pending()
        busy = [(m, m.backend) for m in self.members if m.jobs and m.backend is not None]
        if events or timeout <= 0:
            raw = [(m, ev) for m, b in busy for ev in b.step(0)]
        elif len(busy) == 1:
            raw = [(busy[0][0], ev) for ev in busy[0][1].step(timeout)]
        elif not busy:
            time.sleep(timeout)
            raw = []
        else:
            raw = self._poll(busy, timeout)
        for m, ev in raw:
            events += self._handle(m, ev)
        return events

    def _poll(self, busy: list[tuple[Member, Backend]], timeout: float) -> list[tuple[Member, Event]]:
        """Several backends have jobs: drain each in turn until one has events or time is up."""
        deadline = time.monotonic() + timeout
        while True:
            raw = [(m, ev) for m, b in busy for ev in b.step(0)]
            if raw or time.monotonic() >= deadline:
                return raw
            time.sleep(min(POLL_SLICE, max(0.0, deadline - time.monotonic())))

    def _handle(self, m: Member, ev: Event) -> list[Event]:
        route = self._routes.get(ev.job_id)
        if route is None or route.member is not m:
            return []  # a late event of an attempt that was already given up
        if isinstance(ev, Token):
            route.tokens += 1
            return [ev]
        if isinstance(ev, Restarted):
            route.tokens = 0
            return [ev]
        m.jobs.discard(ev.job_id)
        if isinstance(ev, Done) or not ev.retryable:
            if isinstance(ev, Done):
                ev.extra.setdefault("backend", m.backend.name if m.backend is not None else m.label)
                if ev.finish_reason != "cancelled":
                    with self._lock:
                        m.failures = 0
            del self._routes[ev.job_id]
            return [ev]
        # the backend failed the job: rest it, and run the job on the next one
        with self._lock:
            self._mark_unhealthy(m, ev.error)
        route.tried.append(m)
        route.errors.append(f"{m.label}: {ev.error}")
        route.member = None
        self._pending.append(route)
        return self._place_pending()

    def _place_pending(self) -> list[Event]:
        events: list[Event] = []
        for route in list(self._pending):
            outcome = self._place(route)
            if outcome == "wait":
                continue
            self._pending.remove(route)
            if outcome == "exhausted":
                del self._routes[route.job_id]
                events.append(Failed(route.job_id, "every backend failed: " + "; ".join(route.errors), True))
                continue
            if route.tokens:
                assert route.member is not None
                reason = f"{route.errors[-1]}; restarted on {route.member.label}"
                events.append(Restarted(route.job_id, reason))
                route.tokens = 0
        return events

    def cancel(self, job_id: str) -> None:
        route = self._routes.get(job_id)
        if route is None:
            return
        if route.member is not None and route.member.backend is not None:
            route.member.backend.cancel(job_id)
            return
        self._pending.remove(route)  # waiting for a slot: nothing runs, end it here
        del self._routes[job_id]
        self._ready.append(
            Done(job_id, "cancelled", prompt_tokens=0, completion_tokens=0, extra={"backend": self.name})
        )

    def stats(self) -> dict[str, object]:
        now = self.clock()
        with self._lock:
            members = [
                {
                    **(m.backend.stats() if m.backend is not None else {}),
                    "label": m.label,
                    "healthy": m.healthy,
                    "failures": m.failures,
                    "retry_in": round(max(0.0, m.retry_at - now), 3) if not m.healthy else 0.0,
                    "last_error": m.last_error,
                    "jobs": len(m.jobs),
                }
                for m in self.members
            ]
        first = self._first_healthy()
        return {
            "backend": self.name,
            "serving": first.label if first else None,
            "slots": self.slots,
            "active": len(self._routes),
            "pending": len(self._pending),
            "members": members,
        }

    def close(self) -> None:
        for m in self.members:
            if m.backend is not None:
                m.backend.close()
