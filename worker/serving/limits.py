"""How big a request a worker takes, checked before the work that a big request makes expensive
(so one hostile payload cannot exhaust a worker's memory): before decompressing RQ's payload,
and before tokenizing.

A producer's request is bounded too (backends.base.MAX_REQUEST_CHARS), but a plain RQ producer
or anyone with Redis access can write any hash, and one 256 KB zlib entry can inflate to
hundreds of MB. So the worker reads the compressed payload's length first (HSTRLEN), inflates
it with a bounded `decompressobj(max_length=...)`, and counts the request's characters against
its own context budget. A request over a limit fails at once with a reason naming the limit;
it is never retried on another worker (it would be too big there as well).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from redis import Redis

from backends.contract.embed import JobRequest
from backends.contract.keys import job_key
from backends.contract.rerank import RerankRequest
from backends.contract.schema import MAX_REQUEST_CHARS, GenerateRequest
from backends.contract.text_ops import TextRequest
from backends.registry import BackendSettings

# A token is at most this many characters in the vocabularies we serve (gemma's longest pieces are
# runs of whitespace/punctuation well under this): a request with more characters than
# CHARS_PER_TOKEN x context tokens cannot fit the context, whatever it says.
CHARS_PER_TOKEN = 32
# RQ stores JSON with ensure_ascii: a character takes at most 12 bytes (a surrogate pair of \uXXXX)
JSON_BYTES_PER_CHAR = 12
ENVELOPE_BYTES = 64 * 1024  # function name, sampling fields, stop strings, JSON punctuation


class TooLarge(Exception):
    """The request is over this worker's limit; the message says which and by how much."""


@dataclass(frozen=True)
class RequestBudget:
    max_chars: int  # a request's text, every field together (request_chars)
    context_tokens: int | None  # what the character limit comes from (None: the absolute bound)

    @property
    def max_payload_bytes(self) -> int:
        # an embedding job's inputs are bounded each by the context, together by MAX_REQUEST_CHARS
        return MAX_REQUEST_CHARS * JSON_BYTES_PER_CHAR + ENVELOPE_BYTES

    def describe(self) -> str:
        if self.context_tokens is None:
            return f"at most {self.max_chars:,} characters"
        return (f"at most {self.max_chars:,} characters (a context of {self.context_tokens} tokens "
                f"x {CHARS_PER_TOKEN} characters per token)")


def budget_for(backend: BackendSettings) -> RequestBudget:
    """The in-process engine knows its per-job context; HTTP engines get the absolute bound."""
    if backend.type == "llama-cpp":
        tokens = backend.n_ctx_per_seq
        return RequestBudget(min(MAX_REQUEST_CHARS, tokens * CHARS_PER_TOKEN), tokens)
    return RequestBudget(MAX_REQUEST_CHARS, None)


def check_payload(redis: Redis, job_id: str, budget: RequestBudget) -> None:
    """Raise TooLarge when the job's stored payload is, or inflates to, more than the budget
    allows. Reads the compressed length first and inflates at most max_payload_bytes + 1."""
    limit = budget.max_payload_bytes
    stored = int(redis.hstrlen(job_key(job_id), "data"))
    if stored > limit:
        raise TooLarge(f"refused: request too large: the stored payload is {stored:,} bytes; this "
                       f"worker takes {budget.describe()}")
    raw = redis.hget(job_key(job_id), "data")
    if not isinstance(raw, bytes):
        return  # missing: reading the job reports it
    inflater = zlib.decompressobj()
    try:
        inflated = inflater.decompress(raw, limit + 1)
    except zlib.error:
        return  # not compressed: RQ reads it as is, and its size was checked above
    if len(inflated) > limit or inflater.unconsumed_tail:
        raise TooLarge(f"refused: request too large: the payload inflates to more than {limit:,} "
                       f"bytes; this worker takes {budget.describe()}")


def request_chars(request: JobRequest) -> int:
    """What one context must hold: every text field of a generation job (GenerateRequest.chars)
    or of a text job (a text to tokenize, a chat to render: bounded as a prompt is, though no
    context holds it, since tokenizing it costs as much); an embedding job's longest input; a
    rerank job's query and instruction with its longest document (one context holds them)."""
    if isinstance(request, GenerateRequest | TextRequest):
        return request.chars()
    if isinstance(request, RerankRequest):
        return request.longest()
    return max(map(len, request.input))


def check_request(request: JobRequest, budget: RequestBudget) -> None:
    """Before tokenizing: the request's characters against the context budget."""
    chars = request_chars(request)
    if chars > budget.max_chars:
        raise TooLarge(f"refused: request too large: {chars:,} characters; this worker takes "
                       f"{budget.describe()}")
