"""What the worker writes for observability and the readers read: counter fields, histogram
buckets, history bounds. One place, so the exporter, `fleet status` and the worker agree; it is
in the contract because the worker (worker/hooks/facts.py) writes it and the producers'
dispatcher/observe/ reads it, and neither side may import the other."""

from __future__ import annotations

import math
from typing import Any

HISTORY_TTL = 24 * 3600  # a job's history outlives its result (result_ttl) for post-mortems
HISTORY_CAP = 5_000  # ids kept in each history index (recent, failed per queue)
POOL_COUNTERS_TTL = 90 * 24 * 3600  # refreshed on every write: gone only after a quiet quarter
WORKER_COUNTERS_TTL = 7 * 24 * 3600  # refreshed by the heartbeat while the worker lives
PROMPT_SHOWN = 160  # characters of a prompt kept in the history

# counter fields (same names in the pool and the worker hashes)
TOKENS = "tokens_generated"
PROMPT_TOKENS = "prompt_tokens"
CACHED_TOKENS = "cached_tokens"  # of the prompt tokens, those found in the KV cache (not prefilled)
# of the cached tokens, those read from the host's KV store (backends/llamacpp/kv_store.py)
STORE_RESTORES = "kv_store_restores"
STORE_RESTORED_TOKENS = "kv_store_restored_tokens"
STORE_RESTORE_MS = "kv_store_restore_ms"
# the store's write side, per worker process (its engine's `store_<name>` stats in the heartbeat)
STORE_WRITE_OUTCOMES = ("written", "dropped", "write_errors", "evicted", "removed_bad")
REAPED = "jobs_reaped"
STARTS = "worker_starts"
OUTCOMES = ("finished", "failed", "cancelled")
RESTART_KINDS = ("worker_died", "engine", "fallback", "outage", "shutdown")


def jobs_field(outcome: str) -> str:
    return f"jobs:{outcome}"


def restarts_field(kind: str) -> str:
    return f"restarts:{kind}"


def restart_kind(reason: str) -> str:
    """A bounded label for a free-text restart reason (Prometheus labels must not explode)."""
    text = reason.lower()
    if "died" in text or "previous process" in text:
        return "worker_died"
    if "outage" in text:
        return "outage"
    if "stopped" in text or "exiting" in text:
        return "shutdown"
    if "fallback" in text or "restarted on" in text:
        return "fallback"
    return "engine"


# histograms, seconds; fields are the upper bounds as text plus "+Inf" and "sum"
HISTOGRAMS: dict[str, tuple[float, ...]] = {
    "queue_wait": (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
    "ttft": (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
    "job_duration": (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600),
}
SUM_FIELD = "sum"
INF = "+Inf"


def bucket_field(metric: str, seconds: float) -> str:
    """The field (upper bound) one observation is counted under: buckets are stored per bucket,
    not cumulatively, so one HINCRBY records an observation."""
    for bound in HISTOGRAMS[metric]:
        if seconds <= bound:
            return bound_text(bound)
    return INF


def bound_text(bound: float) -> str:
    return INF if math.isinf(bound) else repr(float(bound))


def cumulative_buckets(metric: str, raw: dict[str, Any]) -> tuple[list[tuple[str, float]], float]:
    """Prometheus' cumulative (le, count) pairs and the sum from a histogram hash."""
    out: list[tuple[str, float]] = []
    total = 0.0
    for bound in (*HISTOGRAMS[metric], math.inf):
        total += float(raw.get(bound_text(bound), 0) or 0)
        out.append((bound_text(bound), total))
    return out, float(raw.get(SUM_FIELD, 0) or 0)


def pool_of(queue: str) -> str:
    """`<pool>:<priority>` -> pool (pool names cannot hold ':')."""
    return queue.rsplit(":", 1)[0] if ":" in queue else queue


def priority_of(queue: str) -> str:
    return queue.rsplit(":", 1)[1] if ":" in queue else "default"


def short_params(request: Any) -> dict[str, Any]:
    """A request as the history keeps it: sampling fields, the prompt (or last message) shortened."""
    data = request.model_dump(exclude_none=True) if hasattr(request, "model_dump") else dict(request)
    chat = data.pop("chat", None)
    if isinstance(chat, dict):  # a text job's chat (apply-template): kept as a chat's fields are
        data = {**chat, **data}
    out: dict[str, Any] = {k: v for k, v in data.items()
                           if k not in ("prompt", "messages", "input", "content", "tokens")}
    if isinstance(data.get("content"), str):  # a text job's (tokenize): shortened; its ids: counted
        out["content"] = shorten(data["content"])
    if isinstance(data.get("tokens"), list):
        out["tokens"] = len(data["tokens"])
    inputs = data.get("input")
    if isinstance(inputs, list) and inputs:  # an embedding job: how many, and the first
        out["inputs"] = len(inputs)
        out["input"] = shorten(str(inputs[0]))
    if isinstance(data.get("prompt"), str):
        out["prompt"] = shorten(data["prompt"])
    messages = data.get("messages")
    if isinstance(messages, list) and messages:
        last = messages[-1]
        content = last.get("content") if isinstance(last, dict) else None
        out["messages"] = len(messages)
        out["last_message"] = shorten(str(content if content is not None else last))
    return out


def shorten(text: str, limit: int = PROMPT_SHOWN) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
