"""Settings of the in-process llama.cpp backend (`backend.type: llama-cpp`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from backends.contract.settings import EngineSettings


class KvStoreSettings(BaseModel):
    """A directory of finished conversations' KV that a host's workers share (kv_store.py)."""

    model_config = ConfigDict(extra="forbid")

    path: Path | None = Field(None, description="directory of the store (tmpfs or a local disk), shared "
                              "by the host's workers; None: no store")
    budget_mb: int = Field(4096, ge=1, description="the store's size: past it, the least recently used "
                           "entries go")
    fsync: bool = Field(False, description="fsync each entry before it is renamed into place (survives "
                        "a power cut, not only a crash; costs a disk flush per entry)")
    min_tokens: int = Field(256, ge=1, description="a finished job's KV is stored when it holds this "
                            "many tokens (shorter: prefilling again costs about what a restore does)")


class LlamaCppSettings(EngineSettings):
    type: Literal["llama-cpp"] = "llama-cpp"
    model_path: Path | None = None  # None: the embedded gemma-3-270m Q4_K_M
    batch_invariant: bool = Field(
        False, description="a job's greedy text is the same alone or in any batch: ggml's tiled "
        "matmul at every batch size (a lone decoder costs ~2x CPU per token); needs kv_unified=false")
    kv_unified: bool = Field(
        False, description="one KV pool of n_ctx cells shared by all slots, a job reserves what it "
        "needs; false (default): one KV stream of n_ctx_per_seq cells per slot and prefix entry, "
        "sliding-window layers keeping only their window (as llama-server)")
    n_ctx: int = Field(16384, ge=256, description="KV cells shared by all slots (kv_unified=true)")
    n_ctx_per_seq: int = Field(4096, ge=64, description="max prompt + generated tokens of one job; with "
                               "per-slot KV streams also the KV cells of each slot and prefix entry")
    n_batch: int = Field(512, ge=16, description="token budget of one decode step (chunked prefill)")
    max_stall_ms: float = Field(
        250, ge=0, description="per-slot streams: while jobs stream, a step prefills only as many "
        "prompt rows as this machine's timed steps say fit in this gap, so a long prompt never "
        "freezes the other streams longer (at least 32 rows a step, and max_prefill_slowdown's "
        "share; 0: whole n_batch chunks)")
    max_prefill_slowdown: float = Field(
        0.1, gt=0, le=1, description="pacing (max_stall_ms) never makes a long prompt's prefill "
        "slower than this fraction: each paced step gives the prompt rows worth at least 1/x times "
        "what the step adds besides them (the streams' call and the step's overhead; its own call's "
        "fixed cost aside), and where that is more than the stall target allows, the gap grows "
        "instead (1: the stall target alone)")
    threads: int | None = Field(None, ge=1, description="None: one per pinned core")
    prefix_cache: int = Field(2, ge=0, description="shared-prefix KV entries kept (LRU)")
    checkpoints: int = Field(1, ge=0, le=8, description="with sliding-window layers kept to their window "
                             "(per-slot streams): checkpoints of that window kept per slot, taken where "
                             "a prompt ends, so a chat's next turn reuses its history even when the "
                             "client edited the answer (0: off)")
    cache_ram_mib: int | None = Field(
        None, ge=0, description="per-slot streams: host RAM (MiB) for finished conversations' KV "
        "state, so a chat whose slot went to other jobs finds its history again (LRU; as "
        "llama-server's --cache-ram); None: an eighth of the host's memory, at most 8192; 0: off")
    kv_store: KvStoreSettings = Field(
        default_factory=KvStoreSettings, description="per-slot streams: a finished job's KV written to "
        "a directory the host's workers share, restored by any of them (docs/conversations.md)")
    draft_max: int = Field(6, ge=0, le=16, description="speculation by prompt lookup: draft tokens a "
                           "decoder may verify per step, while the decoders span 1-8 neighbouring "
                           "slots and this machine's timed steps say it pays (0: off)")
    overlap: bool = Field(False, description="decode the next step on a helper thread while the worker "
                          "writes the last step's tokens to Redis; no gain measured on 2 cores that "
                          "all decode (docs/bench.md, 'Overlapping Redis with llama_decode')")
    chat_template: str | None = Field(
        None, description="a llama.cpp built-in chat template name (e.g. gemma, chatml, llama3) for "
        "chat requests; None: the model's own template, else `gemma` for gemma-family models")
    chat_template_file: Path | None = Field(
        None, description="a Jinja chat template file rendered instead of the model's own (as "
        "llama-server's --chat-template-file)")
    jinja: bool = Field(True, description="render the model's own chat template (or "
                        "chat_template_file) with Jinja, as llama-server --jinja: its tool-call syntax "
                        "and thoughts; false: llama.cpp's built-in templates only")
    tool_format: Literal["native", "generic"] = Field(
        "native", description="tool calls in the model's own syntax where its Jinja template has "
        "one llama-fleet reads (Hermes/Qwen, Llama 3, Mistral, gpt-oss, DeepSeek R1), with a grammar "
        "that starts at the call; generic: every model answers in llama-fleet's JSON tool format")

    embed_model_path: Path | None = Field(
        None, description="GGUF model for embedding jobs; None: the generation model (a second "
        "llama.cpp context on the same weights, made at the first embedding job)")
    embed_n_ctx: int = Field(2048, ge=16, description="tokens of one embedding input at most (longer: "
                             "refused, or cut when the request asks)")
    embed_batch: int = Field(32, ge=1, le=256, description="embedding inputs decoded together (the "
                             "embedding context's sequences)")
    embed_n_batch: int = Field(512, ge=16, description="tokens per llama_decode of the embedding context "
                               "(its logits buffer costs ~1 MB per token with a 262k vocabulary)")
    rerank_n_ctx: int = Field(4096, ge=64, description="tokens of a rerank job's prompt, query and one "
                              "document together at most (longer: refused); the cells of the scoring "
                              "context, made at the first rerank job, where a call's documents sit together")
    rerank_batch: int = Field(32, ge=1, le=256, description="rerank documents scored per call (one "
                              "sequence each, all sharing the query's prefix)")

    @model_validator(mode="after")
    def _invariance_needs_streams(self) -> LlamaCppSettings:
        if self.batch_invariant and self.kv_unified:  # a job's cells at other offsets sum differently
            raise ValueError("batch_invariant needs kv_unified=false (one KV stream per slot)")
        if self.chat_template_file is not None:
            if self.chat_template is not None or not self.jinja:
                raise ValueError("chat_template_file is a Jinja template: it needs jinja=true and no "
                                 "chat_template")
            if not self.chat_template_file.is_file():
                raise ValueError(f"chat_template_file {self.chat_template_file} is not a file")
        return self


def kv_store_section(backend: object) -> KvStoreSettings | None:
    """The KV store section of an engine whose slots keep their own KV (llama-cpp with per-slot
    streams: the layout whose finished KV the store holds); None for every other engine."""
    if isinstance(backend, LlamaCppSettings) and not backend.kv_unified:
        return backend.kv_store
    return None
