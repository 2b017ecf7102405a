"""Every Redis key, key prefix and hash field the fleet uses, in one place (table in
docs/ARCHITECTURE.md). RQ's own keys are named here too where the fleet reads or writes them
directly; they must match what RQ itself uses."""

from __future__ import annotations

from backends.contract.schema import PRIORITIES

# The one function a fleet job may name. Workers refuse (fail, never run) anything else.
JOB_FUNCTION = "dispatcher.jobs.generate"

# -- RQ's keys -------------------------------------------------------------------------------------

QUEUE_PREFIX = "rq:queue:"  # worker/claim.lua strips these 9 characters to name the queue
RQ_WORKERS_SET = "rq:workers"  # RQ's set of registered worker keys


def queue_name(pool: str, priority: str) -> str:
    """RQ queue name; RQ stores it at rq:queue:<pool>:<priority>."""
    return f"{pool}:{priority}"


def queue_names(pool: str) -> list[str]:
    """A pool's queues, highest priority first (the claim order)."""
    return [queue_name(pool, p) for p in PRIORITIES]


def queue_key(name: str) -> str:
    return f"{QUEUE_PREFIX}{name}"


def job_key(job_id: str) -> str:
    return f"rq:job:{job_id}"


def started_registry_key(queue: str) -> str:
    """RQ's StartedJobRegistry (`wip`): executions of jobs now running."""
    return f"rq:wip:{queue}"


def finished_registry_key(queue: str) -> str:
    return f"rq:finished:{queue}"


def failed_registry_key(queue: str) -> str:
    return f"rq:failed:{queue}"


def canceled_registry_key(queue: str) -> str:
    return f"rq:canceled:{queue}"


def rq_worker_key(name: str) -> str:
    """RQ's worker hash (what `rq info` lists)."""
    return f"rq:worker:{name}"


# -- the fleet's keys ------------------------------------------------------------------------------

WORKER_PREFIX = "fleet:worker:"
WORKERS_SET = "fleet:workers"  # names of workers that registered (live or dead, until reaped)
REAPER_LOCK = "fleet:reaper:lock"


def stream_key(job_id: str) -> str:
    """Token stream of one job (Redis Stream, capped, expires with the result)."""
    return f"fleet:stream:{job_id}"


def cancel_key(job_id: str) -> str:
    """Set by a producer to cancel a running job; the worker holding it checks every step."""
    return f"fleet:cancel:{job_id}"


def worker_key(name: str) -> str:
    """Worker status hash; its TTL is the liveness signal (3 heartbeats)."""
    return f"{WORKER_PREFIX}{name}"


def worker_name_of(key: str) -> str:
    """The worker name in a status key (worker_key's inverse)."""
    return key[len(WORKER_PREFIX):]


def inflight_key(name: str) -> str:
    """Job ids a worker holds; claimed by atomic move so the reaper sees them if it dies."""
    return f"fleet:inflight:{name}"


def wake_key(pool: str) -> str:
    """Producers LPUSH here after enqueueing so idle workers wake at once (they also poll)."""
    return f"fleet:wake:{pool}"


# -- hash fields the fleet adds to RQ's job hash --------------------------------------------------

ATTEMPT_FIELD = "fleet_attempt"  # restarts so far (the running attempt is this + 1)
DIED_ON_FIELD = "fleet_died_on"  # workers that died running the job, comma-separated
