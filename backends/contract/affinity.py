"""Which worker holds a job's prefix, as keys a producer and a worker compute alike from a request.

A worker that ran a job keeps its KV (its slot's, or a checkpoint of it): the conversation's next
turn, or the next question on the same document, prefills only what is new there. So a claim
prefers jobs whose prefix this worker holds and leaves to their holder the jobs another live
worker with room holds (backends/contract/queue/claim.lua). Keys hash everything before a boundary: a chat's
boundaries are its messages, a prompt's every BLOCK_CHARS characters. A job carries the keys of
its own prefixes, longest first; a worker, once a job ended, says it holds the keys of the job's
whole prompt and of the prompt with the answer appended (what a client resends next turn).
A producer's explicit hint (OpenAI's `prompt_cache_key`, a conversation id: `cache_key`) is
one more key, taken first. Keys include the tenant: tenants never share KV, nor learn of it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from backends.contract.schema import GenerateRequest

BLOCK_CHARS = 512  # a prompt's prefixes end at multiples of this
MAX_JOB_KEYS = 8  # a job's longest prefixes looked up at a claim
HELD_TTL = 600  # seconds a worker's claim to a prefix lasts after the job that left it
FIELD = "fleet_affinity"  # the job hash field: the job's keys, longest first, space-separated


def held_key(pool: str, key: str) -> str:
    """string: the name of the worker that holds this prefix (TTL HELD_TTL)."""
    return f"fleet:held:{pool}:{key}"


def _chain(tenant: str, pieces: Iterable[str]) -> list[str]:
    """The key after each piece: a hash of the tenant and every piece so far."""
    h = hashlib.blake2b(tenant.encode(), digest_size=12)
    out = []
    for piece in pieces:
        h.update(piece.encode("utf-8", "surrogatepass"))
        out.append(h.copy().hexdigest())
    return out


def _pieces(request: GenerateRequest, answer: str | None = None) -> list[str]:
    if request.messages is not None:
        turns = [(m.role, m.content) for m in request.messages]
        if answer is not None:
            turns.append(("assistant", answer))
        # lengths first: no two different chats give one sequence of pieces
        return [f"{role}:{len(content)}:{content}" for role, content in turns]
    text = (request.prompt or "") + (answer or "")
    return [text[i:i + BLOCK_CHARS] for i in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS)]


def job_keys(request: GenerateRequest) -> list[str]:
    """The keys a claim looks up for this job: its hint, then its prefixes, longest first."""
    keys = _chain(request.tenant or "", _pieces(request))[::-1][:MAX_JOB_KEYS]
    return ([_hint(request)] if request.cache_key else []) + keys


def held_keys(request: GenerateRequest, answer: str) -> list[str]:
    """The keys a worker holds once this job ended with `answer`: its hint, its whole prompt, its
    prompt and answer (a prompt's: up to their last whole block)."""
    held = [_hint(request)] if request.cache_key else []
    for pieces in (_pieces(request), _pieces(request, answer)):
        chain = _chain(request.tenant or "", pieces)
        if chain and chain[-1] not in held:
            held.append(chain[-1])
    return held


def _hint(request: GenerateRequest) -> str:
    return _chain(request.tenant or "", [f"hint:{request.cache_key}"])[0]
