"""What every `fleet bench` workload shares: the machine's description, the run's work dir, and
the fleet's workers pinned to their share of the cores."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil

from ecosystem.local.processes import WorkerProcess, start_worker
from worker.settings import format_cpu_list


def machine_meta() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("model name")), "")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    return {"cores": len(os.sched_getaffinity(0)), "cpu": model, "loadavg": os.getloadavg(),
            "commit": commit, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds the processes have used so far (one that is gone counts 0)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
    return total


def with_children(pid: int) -> list[int]:
    """A process and its children (`fleet serve` with gateway.workers > 1 forks them)."""
    with contextlib.suppress(psutil.Error):
        return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    return [pid]


@contextlib.contextmanager
def workdir(keep: bool) -> Iterator[Path]:
    """A temp dir for the run's logs and Redis; removed after a good run unless `keep`."""
    path = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    ok = False
    try:
        yield path
        ok = True
    finally:
        if ok and not keep:
            shutil.rmtree(path, ignore_errors=True)


def core_shares(n: int, threads: int) -> list[list[int]]:
    """The cores of each of `n` processes: `threads // n` apiece (at least one), in order; with
    more processes than cores, one core each, round robin."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, threads // n)
    return [cores[i * per:(i + 1) * per] or [cores[i % len(cores)]] for i in range(n)]


def start_fleet_workers(redis_url: str, tag: str, log_dir: Path, *, workers: int, threads: int,
                        worker_settings: Mapping[str, Any],
                        backend: Mapping[str, Any]) -> list[WorkerProcess]:
    """`workers` fleet workers named `<tag>-<i>`; with several, each pinned to its share of the
    cores (core_shares). The caller stops them."""
    shares = core_shares(workers, threads)
    started = []
    for i in range(workers):
        extra: dict[str, Any] = {f"backend__{k}": v for k, v in backend.items()}
        extra.update(worker_settings)
        if workers > 1:
            extra["cpus"] = format_cpu_list(shares[i])
        if backend.get("type") == "llama-cpp":  # another engine refuses a thread count
            extra.setdefault("backend__threads", len(shares[i]) if workers > 1 else threads)
        started.append(start_worker(redis_url, f"{tag}-{i}", log_dir, timeout=180, **extra))
    return started
