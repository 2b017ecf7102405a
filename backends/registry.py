"""Which engine a worker runs: `BackendSettings` (every backend's settings under one `type`) and
`make_backend`, which imports only the implementation the settings name (so a worker on an HTTP
backend never imports llama_cpp)."""

from __future__ import annotations

from functools import partial
from typing import Literal

from pydantic import Field

from backends.base import Backend
from backends.fake import FakeSettings
from backends.http_settings import OllamaSettings
from backends.llamacpp_settings import LlamaCppSettings

BackendType = Literal["llama-cpp", "llama-server", "ollama", "fake"]


class BackendSettings(LlamaCppSettings, OllamaSettings, FakeSettings):
    """The `backend` section of worker-config.json: `type` picks the engine, which reads its own
    fields (llama-cpp: LlamaCppSettings; llama-server: HttpSettings; ollama: OllamaSettings;
    fake: FakeSettings). A non-empty `fallback` lists engines to fail over to, in order."""

    type: BackendType = "llama-cpp"
    fallback: list[BackendSettings] = Field(default_factory=list)


def make_backend(settings: BackendSettings, threads: int | None = None) -> Backend:
    """Build the engine `settings.type` names. `threads` is the pinned core count.

    With a non-empty `settings.fallback`, a FallbackBackend over [settings, *fallback]."""
    if settings.fallback:
        return _fallback_chain(settings, threads)
    if settings.type == "llama-cpp":
        from backends.llamacpp import LlamaCppBackend

        engine = LlamaCppBackend(settings, threads=settings.threads or threads)
        if settings.overlap:
            from backends.overlap import OverlappedBackend

            return OverlappedBackend(engine)
        return engine
    if settings.type == "llama-server":
        from backends.llama_server import LlamaServerBackend

        return LlamaServerBackend(settings)
    if settings.type == "ollama":
        from backends.ollama import OllamaBackend

        return OllamaBackend(settings)
    if settings.type == "fake":
        from backends.fake import FakeBackend

        return FakeBackend(settings)
    raise ValueError(f"unknown backend type {settings.type!r}")


def _fallback_chain(settings: BackendSettings, threads: int | None) -> Backend:
    from backends.fallback import FallbackBackend

    chain = [settings, *settings.fallback]
    members = []
    for s in chain:
        single = s.model_copy(update={"fallback": []})
        label = f"{s.type}@{s.endpoint or s.model_path or 'default'}"
        members.append((label, partial(make_backend, single, threads)))
    return FallbackBackend(members, name=">".join(s.type for s in chain))
