"""Settings of the in-process llama.cpp backend (`backend.type: llama-cpp`)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from backends.contract.settings import EngineSettings


class LlamaCppSettings(EngineSettings):
    model_path: Path | None = None  # None: the embedded gemma-3-270m Q4_K_M
    batch_invariant: bool = Field(
        True, description="a job's greedy text is the same alone or in any batch: per-slot KV "
        "streams and batch-invariant kernels (false: one shared KV pool, llama.cpp's default kernels)")
    n_ctx: int = Field(8192, ge=256, description="KV cells shared by all slots (batch_invariant=false)")
    n_batch: int = Field(512, ge=16, description="token budget of one decode step (chunked prefill)")
    threads: int | None = Field(None, ge=1, description="None: one per pinned core")
    prefix_cache: int = Field(2, ge=0, description="shared-prefix KV entries kept (LRU)")
    chat_template: str | None = Field(
        None, description="a llama.cpp built-in chat template name (e.g. gemma, chatml, llama3) for "
        "chat requests; None: the model's own template, else `gemma` for gemma-family models")
