"""Engines behind one small protocol (backends.base). Importing this package never imports
llama_cpp: each implementation is imported only when a worker asks for it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from backends.base import (
    Backend,
    BackendUnavailable,
    Done,
    Event,
    Failed,
    GenerateRequest,
    JobRejected,
    Restarted,
    Token,
)

if TYPE_CHECKING:
    from worker.settings import BackendSettings

__all__ = [
    "Backend",
    "BackendUnavailable",
    "Done",
    "Event",
    "Failed",
    "GenerateRequest",
    "JobRejected",
    "Restarted",
    "Token",
    "make_backend",
]


def make_backend(settings: BackendSettings, threads: int | None = None) -> Backend:
    """Build the engine `settings.type` names. `threads` is the pinned core count.

    With a non-empty `settings.fallback`, a FallbackBackend over [settings, *fallback]."""
    if settings.fallback:
        from backends.fallback import FallbackBackend

        return FallbackBackend.from_settings(settings, threads)
    if settings.type == "llama-cpp":
        from backends.llamacpp import LlamaCppBackend

        return LlamaCppBackend(settings, threads=settings.threads or threads)
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
