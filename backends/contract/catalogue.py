"""The model catalogue: the `models` section of worker-config.json, read alike by workers, the
gateway and the CLI. Each entry names a GGUF file and the options of that model's copies
(context, slots, chat template, pinned, keep_alive); each model waits in a pool of its own
(`pool`, by default the name with characters a pool name may not hold replaced), so a request
for it is an ordinary job on that pool's queues: tenants, priorities, cancels and requeues work
per model as they work per pool.

An entry's file may come from a URL (`url`, HTTP(S) or a Hugging Face resolve URL, with its
`sha256`): a worker that lacks it fetches it on first need (backends/fetch.py); with no `path`
the file is `<model_cache_dir>/<sha256>.gguf` on each host, so copies of one file share it.

Keep-alive durations are read as Ollama reads them (a number of seconds, or a Go duration such as
"5m", "1h30m"); a negative one keeps the model loaded for good.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SHA256 = r"^[0-9a-f]{64}$"
URL = r"^https?://[^\s]+$"
POOL_CHARS = re.compile(r"[^A-Za-z0-9_.-]")
KEEP_ALIVE = 300.0  # Ollama's default: a model idle 5 minutes is unloaded
FOREVER = -1.0
GO_PART = r"(\d+(?:\.\d*)?|\.\d+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)"
GO_DURATION = re.compile(f"(?:{GO_PART})+")
GO_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
            "h": 3600.0}


def duration_seconds(value: object) -> float | None:
    """Seconds of an Ollama keep_alive (number of seconds or Go duration); -1 for a negative one
    (keep for good); None when it is neither."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        text = text.lstrip("+-")
        try:
            seconds = sign * float(text)
        except ValueError:
            if not GO_DURATION.fullmatch(text):
                return None
            seconds = sign * sum(float(n) * GO_UNITS[u] for n, u in re.findall(GO_PART, text))
    else:
        return None
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        return None
    return FOREVER if seconds < 0 else seconds


def model_pool(name: str) -> str:
    """The pool a catalogue model waits in when its entry names none: its name, with every
    character a pool name may not hold (`:`, `/`, ...) made `-` ("gemma3:270m" -> "gemma3-270m")."""
    return POOL_CHARS.sub("-", name) or "-"


class ModelEntry(BaseModel):
    """One model of the catalogue. Unset options take the worker's `backend` section's."""

    model_config = ConfigDict(extra="forbid")

    path: Path = Field(description="the GGUF file (with `url` and none: <model_cache_dir>/<sha256>.gguf)")
    url: str | None = Field(None, pattern=URL, max_length=2048, description="where a worker lacking the "
                            "file fetches it (HTTP(S), a Hugging Face resolve URL); needs `sha256`")
    sha256: str | None = Field(None, pattern=SHA256, description="the file's sha256 (hex), checked "
                               "before a fetched file is used")
    pool: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$", description="the pool its jobs wait "
                             "in; None: the name, made a pool name")
    n_ctx_per_seq: int | None = Field(None, ge=16, description="tokens one job may hold")
    slots: int | None = Field(None, ge=1, le=256, description="jobs one copy runs at once")
    chat_template_file: Path | None = Field(None, description="a Jinja chat template instead of the GGUF's")
    pinned: bool = Field(False, description="loaded at a serving worker's start and never unloaded")
    embedding: bool = Field(False, description="an embedding model: its jobs are embeddings, a generation "
                            "job for it is refused")
    keep_alive: float = Field(KEEP_ALIVE, description="seconds an idle copy stays loaded (a number or a "
                              "Go duration such as \"5m\"); negative: for good")
    memory_mb: int | None = Field(None, ge=1, description="RAM one loaded copy takes; None: estimated "
                                  "from the file and the KV of its slots")

    @field_validator("keep_alive", mode="before")
    @classmethod
    def _duration(cls, v: object) -> float:
        seconds = duration_seconds(v)
        if seconds is None:
            raise ValueError("a number of seconds or a duration such as \"5m\" or \"1h30m\"")
        return seconds

    @model_validator(mode="after")
    def _url_has_digest(self) -> ModelEntry:
        if self.url is not None and self.sha256 is None:
            raise ValueError("a model with a `url` needs its `sha256`: a fetched file is checked before use")
        return self

    def pool_of(self, name: str) -> str:
        return self.pool or model_pool(name)


def with_paths(raw: Any, cache: Path) -> Any:
    """The catalogue's raw entries, each fetched one without a `path` given its file in `cache`."""
    if not isinstance(raw, dict):
        return raw
    out = {}
    for name, entry in raw.items():
        if isinstance(entry, dict) and entry.get("path") is None and isinstance(entry.get("sha256"), str):
            entry = {**entry, "path": cache / f"{entry['sha256']}.gguf"}
        out[name] = entry
    return out


def live_models(config: dict[str, ModelEntry], raw: Mapping[Any, Any], cache: Path) -> dict[str, ModelEntry]:
    """The catalogue now: the config file's models with the live changes (CATALOGUE_KEY's hash)
    over them: an entry added or replaced, `null` a config model deleted. An entry that no longer
    validates (written by another version) is left out rather than stop a process."""
    models = dict(config)
    for key, value in raw.items():
        name = key.decode() if isinstance(key, bytes) else str(key)
        try:
            entry = json.loads(value)
            if entry is None:
                models.pop(name, None)
                continue
            models[name] = ModelEntry.model_validate(with_paths({name: entry}, cache)[name])
        except ValueError:
            continue
    try:
        model_pools(models)
    except ValueError:  # two live entries in one pool (a race of two writers): the config's alone
        return dict(config)
    return models


def stored_entry(entry: ModelEntry, cache: Path) -> dict[str, Any]:
    """An entry as the live catalogue keeps it: a fetched file's path left out when it is the
    cache's default, so each host puts it in its own cache."""
    out = entry.model_dump(mode="json", exclude_defaults=True)
    if entry.sha256 is not None and entry.path == cache / f"{entry.sha256}.gguf":
        out.pop("path", None)
    return out


def shown_pool(pool: str, models: dict[str, ModelEntry]) -> str:
    """The pool the status views show by default: the fleet's, or with a catalogue (whose workers
    serve the models' pools, not the fleet's) its first model's."""
    return next(iter(model_pools(models).values()), pool)


def model_pools(models: dict[str, ModelEntry]) -> dict[str, str]:
    """Catalogue name -> its pool. Two models in one pool would take each other's jobs: refused."""
    pools: dict[str, str] = {}
    for name, entry in models.items():
        pool = entry.pool_of(name)
        other = next((n for n, p in pools.items() if p == pool), None)
        if other is not None:
            raise ValueError(f"models {other!r} and {name!r} would share pool {pool!r}: name one "
                             "entry's `pool`")
        pools[name] = pool
    return pools


def live_copies(raw: dict[bytes, bytes]) -> dict[str, dict[str, Any]]:
    """A pool's copies entries (model_copies_key) that are not stale: worker -> its copy."""
    now_ms = time.time() * 1000
    out = {}
    for worker, value in raw.items():
        try:
            entry = json.loads(value)
        except ValueError:
            continue
        until = entry.get("until") if isinstance(entry, dict) else None
        if isinstance(until, int | float) and until > now_ms:
            out[worker.decode() if isinstance(worker, bytes) else str(worker)] = entry
    return out
