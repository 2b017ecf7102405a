"""Settings of the HTTP backends: `llama-server` (HttpSettings) and Ollama (OllamaSettings).
Kept apart from their code so that reading a config never imports an HTTP client."""

from __future__ import annotations

from pydantic import Field

from backends.contract.settings import EngineSettings


class HttpSettings(EngineSettings):
    endpoint: str | None = None
    parallel: int | None = Field(None, ge=1, description="HTTP concurrency cap")
    connect_timeout: float = Field(30.0, gt=0)


class OllamaSettings(HttpSettings):
    model: str | None = None  # ollama model name
    keep_alive: str = "5m"
