"""Embedding jobs: the request a producer sends (`EmbedRequest`, told apart from a
`GenerateRequest` on the wire by `"kind": "embed"`), how a job's vectors travel in its result,
and the finishing every engine's vectors get (OpenAI's `dimensions`: cut, then L2-normalised).

A result carries each vector as base64 of little-endian float32 (OpenAI's `encoding_format:
"base64"`), in `result["embeddings"]`, input order: JSON floats would be ~4x the bytes in Redis.
`decode_vector` turns one back into floats.

Importable without llama_cpp and without Redis.
"""

from __future__ import annotations

import base64
import math
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from backends.contract.rerank import RerankRequest
from backends.contract.schema import MAX_PROMPT_CHARS, MAX_REQUEST_CHARS, TENANT_PATTERN, GenerateRequest
from backends.contract.text_ops import TextRequest

MAX_EMBED_INPUTS = 2048  # inputs one request may hold (OpenAI's limit)
MAX_DIMENSIONS = 65_536  # a bound for the field; the model's own size is checked by the worker
# A worker's reason for failing an embedding job that can never run as asked (an input over the
# context, `dimensions` over the model's): the gateway answers 400 for these, not 422
REJECTED = "embedding request rejected: "

class EmbedRequest(BaseModel):
    """One embedding job: every input becomes one vector, in order."""

    model_config = ConfigDict(extra="forbid", strict=True)
    kind: Literal["embed"]
    input: list[str] = Field(max_length=MAX_EMBED_INPUTS)
    # OpenAI's matryoshka cut: the first `dimensions` values, normalised again; None: all of them
    dimensions: int | None = Field(None, ge=1, le=MAX_DIMENSIONS)
    # an input longer than the worker's embedding context: cut to fit (Ollama's default), or
    # refused (False: OpenAI's behaviour)
    truncate: bool = False
    normalize: bool = True  # L2-normalised (OpenAI, Ollama's /api/embed); False: as pooled
    tenant: str | None = Field(None, pattern=TENANT_PATTERN)
    key_name: str | None = Field(None, pattern=TENANT_PATTERN)  # the tenant's named key (its budgets)

    @field_validator("input", mode="before")
    @classmethod
    def _texts(cls, v: object) -> object:
        """Clear words for what OpenAI's API also accepts but this fleet does not (token arrays),
        and for what neither accepts (a number, a boolean, an object)."""
        if isinstance(v, str):
            return [v]
        if not isinstance(v, list):
            raise ValueError("must be a string or a list of strings")
        if not v:
            raise ValueError(f"no inputs: send a string or a list of 1 to {MAX_EMBED_INPUTS} strings")
        for i, item in enumerate(v):
            if isinstance(item, int | list) and not isinstance(item, bool):
                raise ValueError(f"item {i} is a token array or number; send text (strings) only")
            if not isinstance(item, str):
                raise ValueError(f"item {i} is not a string")
        return v

    @field_validator("input")
    @classmethod
    def _sizes(cls, v: list[str]) -> list[str]:
        for i, text in enumerate(v):
            if not text:
                raise ValueError(f"item {i} is an empty string")
            if len(text) > MAX_PROMPT_CHARS:
                raise ValueError(f"item {i} has {len(text):,} characters; the limit is {MAX_PROMPT_CHARS:,}")
        total = sum(map(len, v))
        if total > MAX_REQUEST_CHARS:
            limit = MAX_REQUEST_CHARS
            raise ValueError(f"the inputs hold {total:,} characters together; the limit is {limit:,}")
        return v


# what a job's payload is: `kind` tells them apart (text jobs: backends/contract/text_ops.py,
# rerank jobs: backends/contract/rerank.py)
JobRequest = GenerateRequest | EmbedRequest | TextRequest | RerankRequest
KINDS: dict[str, type[EmbedRequest | TextRequest | RerankRequest]] = {
    "embed": EmbedRequest, "text": TextRequest, "rerank": RerankRequest}


def parse_request(payload: Any) -> JobRequest:
    """A job's request from its payload: an embedding job says `"kind": "embed"`, a text job
    `"kind": "text"`, a rerank job `"kind": "rerank"`, anything else is a generation request
    (pydantic's ValidationError for a bad one)."""
    kind = payload.get("kind") if isinstance(payload, Mapping) else None
    model = KINDS.get(kind) if isinstance(kind, str) else None
    return (model or GenerateRequest).model_validate(payload)


def finish_vector(values: Sequence[float], dimensions: int | None, normalize: bool = True) -> list[float]:
    """The first `dimensions` values (all for None), L2-normalised unless `normalize` is False
    (a zero vector stays zero)."""
    cut = list(values[:dimensions] if dimensions else values)
    if not normalize:
        return cut
    norm = math.sqrt(math.fsum(x * x for x in cut))
    return [x / norm for x in cut] if norm > 0 else cut


def encode_vector(values: Sequence[float]) -> str:
    """base64 of little-endian float32: OpenAI's `encoding_format: "base64"`."""
    packed = array("f", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def decode_vector(text: str) -> list[float]:
    packed = array("f")
    packed.frombytes(base64.b64decode(text))
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()


def embeddings_of(result: Mapping[str, Any]) -> list[list[float]]:
    """A finished embedding job's vectors, as floats, in input order."""
    return [decode_vector(v) for v in result.get("embeddings") or []]


def embed_fields(texts: str | Sequence[str], **fields: Any) -> dict[str, Any]:
    """The fields of an embedding job (for `Fleet.submit`): a string is one input."""
    # anything but a sequence of texts goes to validation as it is, which names it (a number
    # is not iterable; an object would iterate over its keys)
    sequence = isinstance(texts, Sequence) and not isinstance(texts, str | bytes)
    inputs = list(texts) if sequence else texts
    return {"kind": "embed", "input": inputs, **fields}


__all__ = ["MAX_EMBED_INPUTS", "REJECTED", "EmbedRequest", "JobRequest", "decode_vector", "embed_fields",
           "embeddings_of", "encode_vector", "finish_vector", "parse_request"]
