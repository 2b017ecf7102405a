"""Every job the run left in Redis, read once the fleet is quiet: its status, tenant, final
entries (with their Redis times), RQ results, usage; and the per-job invariant: each job ended
exactly once.

What "ended exactly once" means per kind of ending (docs/reliability.md, docs/batch.md):

- a job a worker (or the reaper) ended: one final stream entry and one RQ result;
- a job cancelled while queued by its producer (the gateway, when its client left): one final
  entry, a `cancelled` result naming no worker; it never ran, so no RQ result is written;
- a batch line cancelled while queued: a tombstone hash (`status canceled`), no stream; its one
  ending is the batch record's line (checked with the batches).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from redis import Redis

from backends.contract import stream
from backends.contract.keys import BATCH_JOB_PREFIX, job_key, results_key
from backends.contract.replies import as_str
from ecosystem.local.records import stream_entries
from ecosystem.soak.state import job_request, job_tenant

ENDED = ("finished", "failed", "canceled", "stopped")


@dataclass
class JobInfo:
    id: str
    status: str | None  # None: no hash (expired, or lost)
    tenant: str
    origin: str | None
    created_ms: int | None = None  # when the producer created it (RQ's created_at, the producer's clock)
    finals: list[tuple[int, stream.StreamEvent]] = field(default_factory=list)
    rq_results: int = 0
    tombstone: bool = False  # a batch line cancelled while queued

    @property
    def batch_line(self) -> bool:
        return self.id.startswith(BATCH_JOB_PREFIX)

    @property
    def final(self) -> stream.StreamEvent | None:
        return self.finals[0][1] if self.finals else None

    @property
    def end_ms(self) -> int | None:
        return self.finals[0][0] if self.finals else None

    @property
    def cancelled_in_queue(self) -> bool:
        """Cancelled by its producer before any worker ran it (cancel_queued.lua's result)."""
        final = self.final
        data = (final.data or {}) if final is not None and final.kind == "done" else {}
        return data.get("finish_reason") == "cancelled" and not data.get("worker")

    @property
    def worker_ended(self) -> bool:
        """Ended by a worker's (or the reaper's) final write: what tenant usage counts."""
        return self.rq_results > 0

    def usage(self) -> dict[str, int]:
        final = self.final
        if final is None:
            return {}
        if final.kind == "error":
            return {"requests": 1, "failed": 1}
        used = (final.data or {}).get("usage") or {}
        return {"requests": 1, "prompt_tokens": int(used.get("prompt_tokens") or 0),
                "completion_tokens": int(used.get("completion_tokens") or 0)}

    def tokens(self) -> int:
        u = self.usage()
        return u.get("prompt_tokens", 0) + u.get("completion_tokens", 0)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "status": self.status, "tenant": self.tenant, "finals": len(self.finals),
                "rq_results": self.rq_results}


def scan_jobs(redis: Redis, known: set[str]) -> dict[str, JobInfo]:
    """Every job hash in Redis, and every id in `known` (the ids clients were given)."""
    ids = {str(as_str(k))[len(job_key("")):] for k in redis.scan_iter(match=job_key("*"), count=1000)}
    ids |= known
    jobs = {}
    for job_id in sorted(ids):
        raw: dict[bytes, bytes] = redis.hgetall(job_key(job_id))  # type: ignore[assignment]
        status = as_str(raw.get(b"status")) if raw else None
        info = JobInfo(job_id, status, job_tenant(raw) if raw else "?", as_str(raw.get(b"origin")))
        info.tombstone = bool(raw) and job_request(raw) is None and info.batch_line
        info.finals = [(ms, ev) for ms, ev in stream_entries(redis, job_id) if ev.final]
        info.rq_results = int(redis.xlen(results_key(job_id)))
        info.created_ms = _created_ms(raw)
        jobs[job_id] = info
    return jobs


def _created_ms(raw: dict[bytes, bytes]) -> int | None:
    text = as_str(raw.get(b"created_at")) if raw else None
    if not text:
        return None
    try:
        when = datetime.strptime(text.rstrip("Z"), "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=UTC)
    except ValueError:
        return None
    return int(when.timestamp() * 1000)


def ended_once(info: JobInfo) -> str | None:
    """What is wrong with how the job ended, or None. A client told about the job (a final
    answer, an error, a cancel) forgives nothing here: its job must still have ended once."""
    if info.status is None:  # only ids a client was given can lack a hash
        return "lost: a client was given this job id but Redis has no record of it"
    if info.tombstone:
        return None if info.status == "canceled" and not info.finals else (
            f"batch line tombstone with {len(info.finals)} final entries")
    if info.status not in ENDED:
        return f"not ended: status {info.status} after the fleet went quiet"
    if len(info.finals) != 1:
        return f"{len(info.finals)} final stream entries (expected exactly 1)"
    if info.cancelled_in_queue:
        return None if info.rq_results <= 1 else f"{info.rq_results} RQ results"
    if info.rq_results != 1:
        return f"{info.rq_results} RQ results (expected exactly 1)"
    return None
