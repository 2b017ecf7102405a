"""Settings of the HTTP backends: `llama-server` (LlamaServerSettings) and Ollama (OllamaSettings).
Kept apart from their code so that reading a config never imports an HTTP client."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from backends.contract.settings import EngineSettings


class HttpSettings(EngineSettings):
    """What both HTTP backends read. Their concurrency is the server's, not `slots`: llama-server's
    slot count capped by `parallel`, or Ollama's `parallel`."""

    endpoint: str | None = Field(None, description="the server's URL, e.g. http://127.0.0.1:8080")
    parallel: int | None = Field(None, ge=1, description="HTTP concurrency cap")
    connect_timeout: float = Field(30.0, gt=0, description="seconds to wait for the server at start")


class LlamaServerSettings(HttpSettings):
    """`backend.type: llama-server`; the context per job is the server's (`-c` / `--parallel`)."""

    type: Literal["llama-server"] = "llama-server"
    tool_format: Literal["native", "generic"] = Field(
        "native", description="chats with tools go to the server as sent (its --jinja template renders "
        "them, its parser reads the calls back) where its template renders tools; generic: "
        "llama-fleet's JSON tool format, as on a server without --jinja")


class OllamaSettings(HttpSettings):
    type: Literal["ollama"] = "ollama"
    model: str = Field("gemma3:270m", min_length=1, description="the Ollama model name")
    keep_alive: str = Field("5m", description="how long Ollama keeps the model loaded after a request")
    n_ctx_per_seq: int | None = Field(None, ge=64, description="num_ctx sent with each request; None: "
                                      "the model's own, as Ollama loads it")
