"""What the process-manager tests check on real worker processes: where the kernel lets them run,
whether they are still alive, which workers registered, and jobs to keep them busy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil
from redis import Redis

from backends.contract.keys import stream_key
from dispatcher import Fleet
from dispatcher import status as fleet_status
from dispatcher.client import FleetJob
from tests.harness import wait_for


def cpus_allowed(pid: int | str) -> str:
    """Cpus_allowed_list of a process or thread, as the kernel reports it (e.g. '0' or '0-3')."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no Cpus_allowed_list for {pid}")


def thread_cpus(pid: int) -> set[str]:
    """Cpus_allowed_list of every thread of `pid` (llama.cpp's threads must inherit the pin)."""
    return {cpus_allowed(f"{pid}/task/{tid.name}") for tid in Path(f"/proc/{pid}/task").iterdir()}


def alive(pid: int) -> bool:
    """Running and not a zombie (an exited child of a parent that has not reaped it yet)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def registered(redis_url: str, names: list[str], timeout: float = 120) -> dict[str, dict[str, Any]]:
    """Wait until every named worker has its status hash; the rows by name."""
    redis = Redis.from_url(redis_url)

    def rows() -> dict[str, dict[str, Any]] | None:
        live = {str(w["name"]): w for w in fleet_status.workers(redis)}
        return live if all(n in live for n in names) else None

    found: dict[str, dict[str, Any]] = wait_for(rows, timeout, f"workers {names} to register", 0.2)
    return {n: found[n] for n in names}


def submit(fleet: Fleet, n: int, max_tokens: int, tag: str) -> list[FleetJob]:
    return [
        fleet.submit(prompt=f"{tag} {i}: tell me a long story about", max_tokens=max_tokens, seed=i)
        for i in range(n)
    ]


def wait_streaming(redis_url: str, jobs: list[FleetJob], timeout: float = 60) -> None:
    """Until every job has streamed at least one entry (claimed and generating)."""
    redis = Redis.from_url(redis_url)
    wait_for(lambda: all(redis.xlen(stream_key(j.id)) for j in jobs), timeout, "every job to stream")
