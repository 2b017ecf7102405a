"""The one settings model: `worker-config.json`, overridden by `FLEET_*` environment variables.

Priority: explicit arguments > FLEET_* env (nested with `__`, e.g. FLEET_BACKEND__TYPE) >
the JSON file (path from --config / FLEET_CONFIG, default ./worker-config.json) > defaults.
Unknown keys and bad values fail at start with pydantic's message, which names the key.
"""

from __future__ import annotations

import os
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    JsonConfigSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from backends.base import SamplingDefaults

BackendType = Literal["llama-cpp", "llama-server", "ollama", "fake"]
_config_path: ContextVar[Path | None] = ContextVar("fleet_config_path", default=None)


class BackendSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: BackendType = "llama-cpp"
    # llama-cpp (in process)
    model_path: Path | None = None  # None: the embedded gemma-3-270m Q4_K_M
    slots: int = Field(16, ge=1, le=256, description="sequences decoded together in one context")
    batch_invariant: bool = Field(
        False, description="a job's greedy text is the same alone or in any batch: ggml's tiled "
        "matmul at every batch size, no repacked weights (a lone decoder costs ~2x CPU per token); "
        "needs kv_unified=false")
    kv_unified: bool = Field(
        False, description="one KV pool of n_ctx cells shared by all slots, a job reserves what it "
        "needs (false: one KV stream of n_ctx_per_seq cells per slot and prefix entry)")
    n_ctx: int = Field(8192, ge=256, description="KV cells shared by all slots (kv_unified=true)")
    n_ctx_per_seq: int = Field(1024, ge=64, description="max prompt + generated tokens of one job; with "
                               "kv_unified=false, the KV cells of each slot and prefix entry")
    n_batch: int = Field(512, ge=16, description="token budget of one decode step (chunked prefill)")
    threads: int | None = Field(None, ge=1, description="None: one per pinned core")
    prefix_cache: int = Field(2, ge=0, description="shared-prefix KV entries kept (LRU)")
    draft_max: int = Field(6, ge=0, le=16, description="speculation by prompt lookup: draft tokens a "
                           "decoder may verify per step, used only while 1-3 slots decode (0: off)")
    # llama-server / ollama (HTTP)
    endpoint: str | None = None
    model: str | None = None  # ollama model name
    parallel: int | None = Field(None, ge=1, description="HTTP concurrency cap")
    keep_alive: str = "5m"
    connect_timeout: float = Field(30.0, gt=0)
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults)
    fallback: list[BackendSettings] = Field(default_factory=list)
    step_delay: float = Field(0.0, ge=0, le=10, description="fake backend only: seconds each step takes "
                              "(paces test jobs like a real engine)")

    @model_validator(mode="after")
    def _invariance_needs_streams(self) -> BackendSettings:
        if self.batch_invariant and self.kv_unified:  # a job's cells at other offsets sum differently
            raise ValueError("batch_invariant needs kv_unified=false (one KV stream per slot)")
        return self


class FleetSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="FLEET_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    redis_url: str = "redis://127.0.0.1:6379/0"
    pool: str = Field("llm", pattern=r"^[A-Za-z0-9_.-]+$")
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.@-]+$", description="worker name")
    backend: BackendSettings = Field(default_factory=BackendSettings)
    cpus: str | None = Field(None, description="CPU list to pin to, e.g. '0-3,8'")
    numa_node: int | None = Field(None, ge=0)
    heartbeat_interval: float = Field(1.0, gt=0, le=60)
    job_timeout: int = Field(600, ge=1, description="wall seconds a job may run")
    queue_ttl: int | None = Field(None, ge=1, description="seconds a job may wait in the queue")
    result_ttl: int = Field(3600, ge=1)
    max_attempts: int = Field(3, ge=1, le=20)
    reserved_slots: int | None = Field(None, ge=0, description="slots a worker keeps free of low-priority "
                                       "(batch) jobs for interactive ones; None: 1 in 8 (worker/priority.py)")
    drain_grace: float = Field(20.0, ge=0, description="seconds to finish in-flight jobs on SIGTERM")
    observe: bool = Field(True, description="job history, counters and histograms in Redis (the "
                          "status hash is always written: it is the liveness signal)")
    durability: Literal["primary", "replicated"] = Field(
        "primary", description="producers: submit returns once the primary has the job, or (replicated) "
        "once a replica has it too (Redis WAIT; docs/scale-out.md)")
    health_file: Path | None = Field(None, description="worker: file refreshed every beat for `fleet health`")

    @field_validator("cpus")
    @classmethod
    def _cpu_list(cls, v: str | None) -> str | None:
        if v is not None:
            parse_cpu_list(v)
        return v

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = _config_path.get()
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if path is not None:
            sources.append(JsonConfigSettingsSource(settings_cls, json_file=path))
        return tuple(sources)

    def cpu_set(self) -> list[int] | None:
        return parse_cpu_list(self.cpus) if self.cpus else None


class SettingsError(Exception):
    """Config could not be loaded; the message names the file and the key."""


def config_path(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """--config, else FLEET_CONFIG, else ./worker-config.json if it exists."""
    if explicit:
        return Path(explicit)
    if env := os.environ.get("FLEET_CONFIG"):
        return Path(env)
    default = Path("worker-config.json")
    return default if default.exists() else None


def load_settings(path: str | os.PathLike[str] | None = None, *,
                  model: type[FleetSettings] = FleetSettings, **overrides: Any) -> FleetSettings:
    """`model`: FleetSettings or a subclass with more sections (e.g. the gateway's)."""
    cfg = config_path(path)
    if cfg is not None and not cfg.exists():
        raise SettingsError(f"config file not found: {cfg}")
    token = _config_path.set(cfg)
    try:
        return model(**overrides)
    except ValidationError as e:
        where = f" in {cfg}" if cfg else ""
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}" for err in e.errors()
        )
        raise SettingsError(f"bad settings{where}: {problems}") from None
    except ValueError as e:  # malformed JSON file
        raise SettingsError(f"cannot read {cfg}: {e}") from None
    finally:
        _config_path.reset(token)


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
