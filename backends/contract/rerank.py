"""Rerank jobs: a query and documents, one relevance score per document (llama-server's and
Jina's `/v1/rerank`, Cohere's `/v2/rerank`). Told apart from the other jobs on the wire by
`"kind": "rerank"`.

A causal model judges each document as Qwen3-Reranker does: one fixed prompt of an instruction,
the query and the document, and the score is P("yes") / (P("yes") + P("no")) at the next token.
The instruction-and-query part comes first, so its KV is prefilled once per request and shared
by every document (backends/llamacpp/scoring.py). A finished job's result holds `scores` (input
order), and in `rerank` the tokens that took: `prefix_tokens` (prefilled once), `document_tokens`
(each document's own, with the prompt's closing); usage's `prompt_tokens` is every token
prefilled, `cached_tokens` the prefix's tokens each document reused.

A request that can never be scored as sent (a document or a query over the worker's context)
fails with a reason starting `REJECTED`, which the gateway answers with a 400.

Importable without llama_cpp and without Redis.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from backends.contract.schema import MAX_PROMPT_CHARS, MAX_REQUEST_CHARS, TENANT_PATTERN

MAX_RERANK_DOCUMENTS = 10_000  # the bound of the field; gateway.rerank_max_documents is the setting
REJECTED = "rerank request rejected: "
# Qwen3-Reranker's default task, used when the request names none
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


class RerankRequest(BaseModel):
    """One rerank job: every document gets a score, in order."""

    model_config = ConfigDict(extra="forbid", strict=True)
    kind: Literal["rerank"]
    query: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    documents: list[str] = Field(min_length=1, max_length=MAX_RERANK_DOCUMENTS)
    instruction: str = Field(DEFAULT_INSTRUCTION, min_length=1, max_length=MAX_PROMPT_CHARS)
    tenant: str | None = Field(None, pattern=TENANT_PATTERN)
    key_name: str | None = Field(None, pattern=TENANT_PATTERN)  # the tenant's named key (its budgets)

    @field_validator("documents")
    @classmethod
    def _sizes(cls, v: list[str]) -> list[str]:
        for i, text in enumerate(v):
            if not text:
                raise ValueError(f"document {i} is an empty string")
            if len(text) > MAX_PROMPT_CHARS:
                raise ValueError(f"document {i} has {len(text):,} characters; the limit is "
                                 f"{MAX_PROMPT_CHARS:,}")
        total = sum(map(len, v))
        if total > MAX_REQUEST_CHARS:
            raise ValueError(f"the documents hold {total:,} characters together; the limit is "
                             f"{MAX_REQUEST_CHARS:,}")
        return v

    def longest(self) -> int:
        """Characters one context must hold: the query and instruction with the longest document."""
        return len(self.query) + len(self.instruction) + max(map(len, self.documents))


def rerank_fields(query: str, documents: list[str], **fields: Any) -> dict[str, Any]:
    """The fields of a rerank job (for `Fleet.submit`)."""
    return {"kind": "rerank", "query": query, "documents": documents, **fields}


__all__ = ["DEFAULT_INSTRUCTION", "MAX_RERANK_DOCUMENTS", "REJECTED", "RerankRequest", "rerank_fields"]
