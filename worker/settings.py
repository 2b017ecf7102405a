"""The worker's settings: `FleetSettings` composes the producer's settings (Redis, pool, TTLs) with
the worker's own (name, pinning, heartbeat, attempts) and the backend's (backends.registry).

Loaded from `worker-config.json`, overridden by `FLEET_*` environment variables (the machinery and
its priority rules: backends/contract/settings.py). Unknown keys and bad values fail at start with
pydantic's message, which names the key. One file configures the whole fleet, so the gateway's
section is checked here too, with the gateway's own model (from the contract,
backends/contract/gateway_settings.py: the worker never imports the gateway).

The `backend` section is merged key by key across sources (a FLEET_BACKEND__SLOTS beside the file's
section), with one rule: the section's engine is the `type` of the highest-priority source that
names one, and a lower source whose section was written for another engine gives only the keys
every backend has (slots, sampling, fallback). So FLEET_BACKEND__TYPE=llama-server over a file set
up for llama-cpp leaves the file's kv_unified, n_batch, ... out; a key of another engine in the
same source as the type (or in one that does not switch it) stops the worker, naming key and type.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from backends.contract.gateway_settings import GatewaySettings
from backends.contract.settings import ProducerSettings, SettingsError, config_path, load
from backends.registry import DEFAULT_TYPE, SHARED_KEYS, BackendSettings, BackendType, LlamaCppSection

__all__ = ["BackendSettings", "BackendType", "FleetSettings", "SettingsError", "config_path",
           "format_cpu_list", "load_settings", "parse_cpu_list"]


class FleetSettings(ProducerSettings):
    model_config = SettingsConfigDict(extra="forbid")

    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.@-]+$", description="worker name")
    backend: BackendSettings = Field(default_factory=LlamaCppSection)
    cpus: str | None = Field(None, description="CPU list to pin to, e.g. '0-3,8'")
    numa_node: int | None = Field(None, ge=0)
    heartbeat_interval: float = Field(1.0, gt=0, le=60)
    max_attempts: int = Field(3, ge=1, le=20)
    reserved_slots: int | None = Field(None, ge=0, description="slots a worker keeps free of low-priority "
                                       "(batch) jobs for interactive ones; None: 1 in 8 "
                                       "(worker/claiming/priority.py)")
    batch_share: float = Field(0.5, ge=0, le=16, description="while interactive jobs run, low-priority "
                               "jobs per interactive one (at least one): bounds what a batch adds to a "
                               "step, hence to interactive time to first token (worker/claiming/priority.py)")
    placement: bool = Field(True, description="claim the jobs whose prefixes (a chat's history) this "
                            "worker holds, and leave to other live workers with a free slot the ones "
                            "they hold (backends/contract/queue/placement.lua); false: queue order only")
    stream_interval: float = Field(0.03, ge=0, le=1, description="seconds between writes of running "
                                   "jobs' new text to Redis (fewer writes, and less CPU taken from the "
                                   "engine: a few tokens a write at one user); a job's first text and "
                                   "every ending go out at once; 0: after every step")
    drain_grace: float = Field(20.0, ge=0, description="seconds to finish in-flight jobs on SIGTERM")
    start_nice: int = Field(0, ge=0, le=19, description="while the worker starts (its model loading "
                            "and warming), it runs this much nicer, so workers serving on the same "
                            "cores keep their streams' pace; back to its own priority once it serves, "
                            "and only where it may go back (worker/machine/priority.py; 0, the "
                            "default: off, since on a saturated box a nicer start takes much longer)")
    stall_limit: float = Field(20.0, gt=0, description="seconds one engine call of the loop (a job's "
                               "admission: its chat template, its tokens, its grammar; a step) may take "
                               "before the worker is taken for hung: the job(s) of that call are marked "
                               "(two such hangs fail a job), its jobs handed back, and the process exits "
                               "(code 70) for its supervisor to restart (worker/liveness/watchdog.py). "
                               "Above a render's own limit (5 s) and the slowest step on this host")
    reconcile_interval: float = Field(5.0, gt=0, le=60, description="seconds between checks that Redis "
                                      "and the loop agree on the jobs this worker holds")
    observe: bool = Field(True, description="job history, counters and histograms in Redis (the "
                          "status hash is always written: it is the liveness signal)")
    health_file: Path | None = Field(None, description="worker: file refreshed every beat for `fleet health`")
    serve_models: list[str] | None = Field(None, description="the catalogue's models (`models`) this worker "
                                           "may load and serve; None: all of them; []: none, the worker "
                                           "serves `pool` with `backend`'s model as without a catalogue")
    memory_budget_mb: int | None = Field(None, ge=1, description="RAM the models a worker holds may take "
                                         "together; None: 80 % of the host's (backends/shelf.py)")
    second_copy_after: float = Field(5.0, ge=0, description="seconds a catalogue model's jobs wait with "
                                     "every worker holding it full before an idle worker that may serve "
                                     "it loads another copy; 0: never (one copy per model, as Ollama)")
    gateway: GatewaySettings = Field(default_factory=GatewaySettings,
                                     description="`fleet serve`'s section (docs/gateway.md); the "
                                     "worker only checks it")

    @field_validator("cpus")
    @classmethod
    def _cpu_list(cls, v: str | None) -> str | None:
        if v is not None:
            parse_cpu_list(v)
        return v

    @model_validator(mode="after")
    def _served_models_exist(self) -> FleetSettings:
        unknown = sorted(set(self.serve_models or ()) - set(self.models))
        if unknown:
            raise ValueError(f"serve_models names {', '.join(map(repr, unknown))}, not in `models`")
        return self

    @property
    def silent_for_dead(self) -> float:
        """Seconds a worker may stay silent before the fleet takes it for dead: its status key's
        life, the reaper's hold-off and a model loading lock's life (three missed beats)."""
        return 3 * self.heartbeat_interval

    def catalogue_served(self) -> list[str]:
        """The catalogue models this worker serves, in the catalogue's order; [] for a one-model worker."""
        if self.serve_models is None:
            return list(self.models)
        return [m for m in self.models if m in self.serve_models]

    def cpu_set(self) -> list[int] | None:
        return parse_cpu_list(self.cpus) if self.cpus else None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources = super().settings_customise_sources(
            settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings)
        return (OneEngine(settings_cls, sources),)


class OneEngine(PydanticBaseSettingsSource):
    """`sources` (highest priority first) merged as pydantic-settings merges them, but for the
    rule on `backend` in this module's docstring."""

    def __init__(self, settings_cls: type[BaseSettings],
                 sources: tuple[PydanticBaseSettingsSource, ...]) -> None:
        super().__init__(settings_cls)
        self.sources = sources

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ takes whole sources

    def __call__(self) -> dict[str, Any]:
        states = [source() for source in self.sources]
        sections = [s.get("backend") for s in states]
        engines: list[object] = []  # each source's engine: its own type, else that of those below
        engine: object = DEFAULT_TYPE
        for section in reversed(sections):
            if isinstance(section, dict) and "type" in section:
                engine = section["type"]
            engines.append(engine)
        engines.reverse()
        merged: dict[str, Any] = {}
        for state, section, own in reversed(list(zip(states, sections, engines, strict=True))):
            if isinstance(section, dict) and own != engines[0]:
                state = {**state, "backend": {k: v for k, v in section.items() if k in SHARED_KEYS}}
            merged = _deep_merge(merged, state)
        return merged


def _deep_merge(low: dict[str, Any], high: dict[str, Any]) -> dict[str, Any]:
    out = dict(low)
    for key, value in high.items():
        below = out.get(key)
        out[key] = _deep_merge(below, value) if isinstance(value, dict) and isinstance(below, dict) else value
    return out


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
