"""Settings loading for every part of the fleet: `worker-config.json`, overridden by `FLEET_*`
environment variables, and the settings models shared across layers.

Priority: explicit arguments > FLEET_* env (nested with `__`, e.g. FLEET_BACKEND__TYPE) >
the JSON file (path from --config / FLEET_CONFIG, default ./worker-config.json) > defaults.
Unknown keys and bad values fail at start with pydantic's message, which names the key.

Each part owns its model: producers `ProducerSettings` (here), each backend its own (next to its
code, built on `EngineSettings`), the worker `FleetSettings` (worker/settings.py) composing them.
"""

from __future__ import annotations

import os
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from pydantic_settings import (
    BaseSettings,
    JsonConfigSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from backends.contract.catalogue import ModelEntry, model_pools, with_paths
from backends.contract.schema import SamplingDefaults

_config_path: ContextVar[Path | None] = ContextVar("fleet_config_path", default=None)
S = TypeVar("S", bound=BaseSettings)


class SettingsError(Exception):
    """Config could not be loaded; the message names the file and the key."""


class FileAndEnvSettings(BaseSettings):
    """Read from init arguments, then FLEET_* env, then the JSON file `load()` was given."""

    model_config = SettingsConfigDict(env_prefix="FLEET_", env_nested_delimiter="__", extra="forbid",
                                      validate_default=True)

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


def cache_dir() -> Path:
    """$FLEET_CACHE_DIR, else ~/.cache/llama-fleet (models, llama-server builds, PM2)."""
    return Path(os.environ.get("FLEET_CACHE_DIR") or Path.home() / ".cache" / "llama-fleet")


def models_dir(setting: Path | None) -> Path:
    return setting or cache_dir() / "models"


# Top-level keys of the one worker-config.json that parts above the producers own: the worker's
# (worker/settings.py FleetSettings) and the gateway's section. The contract cannot import those
# models, so it knows their names (tests/test_config_one_file.py keeps the list equal to
# FleetSettings' fields).
OTHER_PARTS_KEYS = frozenset({
    "name", "backend", "cpus", "numa_node", "heartbeat_interval", "max_attempts", "reserved_slots",
    "batch_share", "placement", "stream_interval", "drain_grace", "start_nice", "stall_limit",
    "reconcile_interval", "observe", "health_file", "gateway", "serve_models", "memory_budget_mb",
    "second_copy_after",
})


class ProducerSettings(FileAndEnvSettings):
    """What a producer (`Fleet`, the gateway) needs from the shared config. Keys of other parts
    (backend, cpus, ...) are left to their owners' models; a key no part knows is refused, so a
    typo stops a producer as it stops a worker."""

    model_config = SettingsConfigDict(extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    pool: str = Field("llm", pattern=r"^[A-Za-z0-9_.-]+$")
    job_timeout: int = Field(600, ge=1, description="wall seconds a job may run")
    queue_ttl: int | None = Field(None, ge=1, description="seconds a job may wait in the queue")
    result_ttl: int = Field(3600, ge=1)
    durability: Literal["primary", "replicated"] = Field(
        "primary", description="producers: submit returns once the primary has the job, or (replicated) "
        "once a replica has it too (Redis WAIT; docs/scale-out.md)")
    model_cache_dir: Path | None = Field(None, description="where this host keeps the catalogue's fetched "
                                         "files (a model with a `url`); None: <cache dir>/models")
    models: dict[str, ModelEntry] = Field(default_factory=dict, description="the model catalogue: name "
                                          "-> GGUF file and options (backends/contract/catalogue.py); "
                                          "each model waits in a pool of its own")

    @field_validator("models", mode="before")
    @classmethod
    def _fetched_files_cached(cls, v: Any, info: ValidationInfo) -> Any:
        return with_paths(v, models_dir(info.data.get("model_cache_dir")))

    def models_dir(self) -> Path:
        """Where this host keeps the catalogue's fetched files."""
        return models_dir(self.model_cache_dir)

    @field_validator("models")
    @classmethod
    def _one_pool_a_model(cls, v: dict[str, ModelEntry]) -> dict[str, ModelEntry]:
        model_pools(v)
        return v

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls.model_config.get("extra") != "forbid":
            known = {*cls.model_fields, *OTHER_PARTS_KEYS}
            unknown = sorted(str(k) for k in data if k not in known)
            if unknown:
                raise PydanticCustomError("unknown_keys", "unknown key(s) {keys}: not a setting of any "
                                          "part of the fleet", {"keys": ", ".join(map(repr, unknown))})
        return data


class EngineSettings(BaseModel):
    """What every backend's settings have: which engine, its concurrency, its sampling defaults.
    Each backend narrows `type` to its own name and adds only the keys it reads, so a key of
    another engine is refused rather than ignored."""

    model_config = ConfigDict(extra="forbid")

    type: str = Field(description="the engine; each backend's model fixes it to its own name")
    slots: int = Field(16, ge=1, le=256, description="sequences decoded together in one context")
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults)


def config_path(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """--config, else FLEET_CONFIG, else ./worker-config.json if it exists."""
    if explicit:
        return Path(explicit)
    if env := os.environ.get("FLEET_CONFIG"):
        return Path(env)
    default = Path("worker-config.json")
    return default if default.exists() else None


def load(model: type[S], path: str | os.PathLike[str] | None = None, **overrides: Any) -> S:
    """`model` from the config file (`config_path(path)`), env and `overrides`; SettingsError
    naming the file and every bad key otherwise."""
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
