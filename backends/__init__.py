"""Engines behind one small protocol (backends.base). Importing this package imports nothing but
the protocol and the shared contract (never llama_cpp); `backends.registry.make_backend` builds
the engine a worker's settings name, importing only that implementation."""

from __future__ import annotations

from backends.base import Backend, BackendUnavailable, Done, Event, Failed, JobRejected, Restarted, Token
from backends.contract.schema import GenerateRequest

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
]
