"""The worker's settings: `FleetSettings` composes the producer's settings (Redis, pool, TTLs) with
the worker's own (name, pinning, heartbeat, attempts) and the backend's (backends.registry).

Loaded from `worker-config.json`, overridden by `FLEET_*` environment variables (the machinery and
its priority rules: backends/contract/settings.py). Unknown keys and bad values fail at start with
pydantic's message, which names the key. One file configures the whole fleet, so the gateway's
section is checked here too, with the gateway's own model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from backends.contract.settings import ProducerSettings, SettingsError, config_path, load
from backends.registry import BackendSettings, BackendType
from dispatcher.gateway.settings import GatewaySettings

__all__ = ["BackendSettings", "BackendType", "FleetSettings", "SettingsError", "config_path",
           "format_cpu_list", "load_settings", "parse_cpu_list"]


class FleetSettings(ProducerSettings):
    model_config = SettingsConfigDict(extra="forbid")

    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.@-]+$", description="worker name")
    backend: BackendSettings = Field(default_factory=BackendSettings)
    cpus: str | None = Field(None, description="CPU list to pin to, e.g. '0-3,8'")
    numa_node: int | None = Field(None, ge=0)
    heartbeat_interval: float = Field(1.0, gt=0, le=60)
    max_attempts: int = Field(3, ge=1, le=20)
    reserved_slots: int | None = Field(None, ge=0, description="slots a worker keeps free of low-priority "
                                       "(batch) jobs for interactive ones; None: 1 in 8 (worker/priority.py)")
    batch_share: float = Field(0.5, ge=0, le=16, description="while interactive jobs run, low-priority "
                               "jobs per interactive one (at least one): bounds what a batch adds to a "
                               "step, hence to interactive time to first token (worker/priority.py)")
    drain_grace: float = Field(20.0, ge=0, description="seconds to finish in-flight jobs on SIGTERM")
    reconcile_interval: float = Field(5.0, gt=0, le=60, description="seconds between checks that Redis "
                                      "and the loop agree on the jobs this worker holds")
    observe: bool = Field(True, description="job history, counters and histograms in Redis (the "
                          "status hash is always written: it is the liveness signal)")
    health_file: Path | None = Field(None, description="worker: file refreshed every beat for `fleet health`")
    gateway: GatewaySettings = Field(default_factory=GatewaySettings,
                                     description="`fleet serve`'s section (docs/gateway.md); the "
                                     "worker only checks it")

    @field_validator("cpus")
    @classmethod
    def _cpu_list(cls, v: str | None) -> str | None:
        if v is not None:
            parse_cpu_list(v)
        return v

    def cpu_set(self) -> list[int] | None:
        return parse_cpu_list(self.cpus) if self.cpus else None


def load_settings(path: str | os.PathLike[str] | None = None, *,
                  model: type[FleetSettings] = FleetSettings, **overrides: Any) -> FleetSettings:
    """`model`: FleetSettings or a subclass with more sections (e.g. the gateway's)."""
    return load(model, path, **overrides)


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8] (the kernel's cpulist format)."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo or lo < 0:
                    raise ValueError
                cpus.update(range(lo, hi + 1))
            else:
                if int(part) < 0:
                    raise ValueError
                cpus.add(int(part))
    except ValueError:
        raise ValueError(f"bad CPU list {text!r} (expected e.g. '0-3,8')") from None
    if not cpus:
        raise ValueError(f"empty CPU list {text!r}")
    return sorted(cpus)


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8'."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)
