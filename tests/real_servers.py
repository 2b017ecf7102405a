"""Real servers for the HTTP-backend tests: a llama-server process (ecosystem.local.llama_server,
built by scripts/build-llama-server, cached) and the in-process Ollama-API test server, both on the
real model.

FLEET_TEST_THREADS sets llama-server's -t (default: the cores this process may run on, one when
the suite runs in parallel); on a box busy compiling, 1 avoids ggml's spinning thread barriers
fighting for the two cores."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from backends.model import default_model_path
from ecosystem.local.llama_server import LlamaServer, llama_server_binary, start_llama_server
from ecosystem.local.processes import free_port
from tests.harness import ROOT

__all__ = ["ROOT", "LlamaServer", "free_port", "llama_server", "llama_server_binary", "model_path"]


def model_path() -> Path:
    return default_model_path()


def llama_server(
    log_dir: Path, parallel: int = 4, ctx: int = 4096, wait: bool = True, port: int | None = None,
    extra_args: Sequence[str] = (),
) -> LlamaServer:
    """A llama-server for a test (`with llama_server(...) as s:` stops it at the end)."""
    threads = int(os.environ.get("FLEET_TEST_THREADS", len(os.sched_getaffinity(0))))
    return start_llama_server(log_dir, parallel=parallel, ctx=ctx, threads=threads, port=port, wait=wait,
                              extra_args=extra_args)
