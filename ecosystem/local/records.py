"""What a job left in Redis, read back by the reliability tests and `fleet soak`: its stream's
entries (void attempts included), its final entries, and the jobs that did not end exactly once
(docs/reliability.md: one final stream entry and one RQ result per job)."""

from __future__ import annotations

from typing import Any

from redis import Redis

from backends.contract import stream
from backends.contract.keys import results_key, stream_key
from backends.contract.replies import as_str


def stream_entries(redis: Redis, job_id: str) -> list[tuple[int, stream.StreamEvent]]:
    """Every stored entry of the job's stream, void attempts included, with the Redis time (ms)
    it was written at."""
    entries: Any = redis.xrange(stream_key(job_id))
    return [(int(str(as_str(entry_id)).split("-")[0]), stream.decode(fields)) for entry_id, fields in entries]


def stream_events(redis: Redis, job_id: str) -> list[stream.StreamEvent]:
    """Every stored entry of the job's stream, void attempts included."""
    return [ev for _ms, ev in stream_entries(redis, job_id)]


def final_entries(redis: Redis, job_id: str) -> list[stream.StreamEvent]:
    return [ev for ev in stream_events(redis, job_id) if ev.final]


def not_ended_once(redis: Redis, job_ids: list[str]) -> dict[str, dict[str, int]]:
    """Job id -> its counts, for each job without exactly one final stream entry and one RQ
    result: lost (none) or finished twice."""
    problems = {}
    for job_id in job_ids:
        finals = len(final_entries(redis, job_id))
        rq_results = int(redis.xlen(results_key(job_id)))
        if (finals, rq_results) != (1, 1):
            problems[job_id] = {"final stream entries": finals, "RQ results": rq_results}
    return problems
