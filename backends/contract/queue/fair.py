"""The tenants' fair share in tokens: the Virtual Token Counter ("Fairness in Serving Large
Language Models", OSDI 2024). This module and claim.lua (+ fair_correct.lua) own the rule.

- Each tenant with work at one pool and priority has a counter (`keys.fair_key`'s zset score):
  the service its jobs got, in weighted tokens (`FairTokens`: prompt, generated, cached) divided
  by the tenant's `weight`. The claim serves the tenant with work whose counter is lowest.
- At the claim a job is charged its estimate (`SIZE_FIELD`, written by its producer: prompt
  tokens, characters / 4 when the producer cannot count them, and `max_tokens` if set; a job
  with no size is charged `FairTokens.unsized`); at its ending the worker corrects the charge to
  the real usage (`correct_call`, in the ending's MULTI). What was charged is kept in the job hash
  (`CHARGED_FIELD`), so a job handed back (a dead worker, a drain) is never charged twice, and a
  correction applied twice changes nothing.
- A tenant that gets work is listed at `NEWCOMER`; its first visit by the claim lifts it to the
  larger of the lowest counter of the tenants with work and its own counter from before
  (`keys.fair_spent_key`): idle time earns no credit and a short absence erases no debt.

Slots follow the counters too (tenant_share.lua): a tenant behind in tokens may take free slots
beyond its weight's share, and one a whole job ahead makes nobody give way to it.

So among tenants with work no counter runs ahead of the lowest by more than one job's worth
(the largest charge over the tenant's weight), or two where slots are shared: `spread_bound`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from backends.contract.embed import EmbedRequest, JobRequest
from backends.contract.gateway_settings import FairTokens
from backends.contract.keys import FAIR_NEWCOMER, fair_key, fair_spent_key, job_key
from backends.contract.queue.scripts import queue_script
from backends.contract.schema import GenerateRequest

NEWCOMER = FAIR_NEWCOMER  # the score a tenant enters the fair share with: lifted at its first visit
CHARS_PER_TOKEN = 4  # the estimate when the producer has no tokenizer

FAIR_CORRECT = queue_script("fair_correct.lua")


def prompt_chars(request: JobRequest) -> int:
    if isinstance(request, GenerateRequest):
        return len(request.prompt or "") + sum(len(m.content) + len(m.reasoning_content or "")
                                               for m in request.messages or [])
    if isinstance(request, EmbedRequest):
        return sum(len(text) for text in request.input)
    return 0


def size_field(request: JobRequest, prompt_tokens: int | None = None) -> str:
    """The job's size for the claim's charge: "<prompt tokens> <max_tokens, 0 if unset>"."""
    if prompt_tokens is None:
        prompt_tokens = math.ceil(prompt_chars(request) / CHARS_PER_TOKEN)
    max_tokens = request.max_tokens if isinstance(request, GenerateRequest) else None
    return f"{max(0, prompt_tokens)} {max_tokens or 0}"


def served(usage: Mapping[str, Any], weights: FairTokens) -> float:
    """A job's real service in weighted tokens, from its result's usage (cached tokens are part
    of prompt_tokens, and weigh their own)."""
    prompt = max(0, int(usage.get("prompt_tokens") or 0))
    cached = min(prompt, max(0, int(usage.get("cached_tokens") or 0)))
    generated = max(0, int(usage.get("completion_tokens") or 0))
    return weights.prompt * (prompt - cached) + weights.cached * cached + weights.generated * generated


def claim_args(weights: FairTokens) -> dict[str, float]:
    """The token weights as the claim's share argument carries them (claim.lua `charge`)."""
    return {"p": weights.prompt, "g": weights.generated, "u": weights.unsized}


def correct_call(job_id: str, queue: str, tenant: str, real: float) -> tuple[list[str], list[Any]]:
    """fair_correct.lua's keys and arguments: job `job_id` of pool queue `queue` served `real`
    weighted tokens (`served`)."""
    return [job_key(job_id), fair_key(queue), fair_spent_key(queue)], [tenant, repr(float(real))]


def size_charge(size: str, weights: FairTokens) -> float:
    """What the claim charges a job of `SIZE_FIELD` `size` (claim.lua's `estimate`)."""
    parts = size.split()
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return float(weights.unsized)
    return weights.prompt * int(parts[0]) + weights.generated * int(parts[1])


def spread_bound(largest_charge: float, shared_slots: bool) -> float:
    """How far one tenant's counter may run ahead of the lowest among tenants with work, given
    the largest job charge over its tenant's weight: one job's worth; one more where workers
    share their slots between tenants, as a tenant at its share of a worker's slots is passed
    over for the next (the claim stays work conserving)."""
    return largest_charge * (2 if shared_slots else 1)
