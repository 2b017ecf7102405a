"""The plain state the scheduler and the KV bookkeeper work on: a job waiting for a slot, a job
holding one (a llama.cpp sequence id), and what the executor sampled for a job. No llama.cpp here."""

from __future__ import annotations

from dataclasses import dataclass, field

from backends.base import Done
from backends.contract.schema import FinishReason, Sampling
from backends.llamacpp.speculation import NgramIndex
from backends.llamacpp.text import TextAssembler


@dataclass(slots=True)
class WaitingJob:
    job_id: str
    tokens: list[int]  # the prompt (for a resumed job, then the tokens of the text it delivered)
    sampling: Sampling
    resumed: int = 0  # of `tokens`, the last ones a dead attempt generated: counted as output
    tenant: str = ""  # whose job (the KV store keeps tenants apart)
    store_ms: float = 0.0  # reading a state from the KV store for it took this long (admission)
    reading: bool = False  # the KV store's reader is looking for it: it starts when that is done
    reading_since: float = 0.0  # perf_counter() when the read was asked for


@dataclass(slots=True)
class ActiveJob:
    """A job holding a sequence id: its prompt, how far its KV is, what it generated."""

    job_id: str
    seq_id: int
    tokens: list[int]  # the prompt
    sampling: Sampling
    reserved: int  # KV cells reserved for this job (unified pool)
    text: TextAssembler
    n_past: int = 0  # tokens already in the KV cache
    chunks: int = 0  # prompt chunks prefilled so far
    next_token: int | None = None  # sampled, not yet fed back: the job is decoding
    generated: int = 0
    output: list[int] = field(default_factory=list)  # generated token ids (fed back into the KV)
    done: Done | None = None  # finished or cancelled: released at the end of the step
    ngrams: NgramIndex | None = None  # prompt + output, for drafts (speculation on)
    resumed: int = 0  # the last `resumed` of `tokens` are a dead attempt's output, prefilled again
    reused: int = 0  # of `tokens`, the first ones whose KV was found, not prefilled (kv.reuse_prefix)
    tenant: str = ""
    restored: int = 0  # of `reused`, those read from the KV store (kv_store.py)
    store_ms: float = 0.0

    @classmethod
    def start(cls, job: WaitingJob, seq_id: int, reserved: int) -> ActiveJob:
        text = TextAssembler(job.sampling.stop, job.sampling.end_at_repeated_call, job.sampling.dialect)
        return cls(job.job_id, seq_id, job.tokens, job.sampling, reserved, text, generated=job.resumed,
                   resumed=job.resumed, tenant=job.tenant, store_ms=job.store_ms)

    @property
    def prompt_tokens(self) -> int:
        """The request's own prompt (a resumed job's delivered text counts as its output)."""
        return len(self.tokens) - self.resumed

    def ended(self, reason: FinishReason) -> Done:
        """The job's Done: its usage, the prompt tokens it did not prefill counted as cached
        (a resumed job's delivered text is output, not prompt, whether reused or not)."""
        extra: dict[str, object] = {}
        if self.restored:  # read from the KV store (kv_store.py): in the result's timings
            extra = {"kv_restored_tokens": self.restored, "kv_restored_ms": round(self.store_ms, 1)}
        return Done(self.job_id, reason, self.prompt_tokens, self.generated,
                    cached_tokens=min(self.reused, self.prompt_tokens), extra=extra)

    def kv_tokens(self) -> list[int]:
        """The tokens whose KV this job's sequence holds, in position order."""
        return (self.tokens + self.output)[: self.n_past]


@dataclass(slots=True)
class Sampled:
    """What a call's rows gave (executor -> scheduler), by sequence id. A job's rows: its next
    token, then one per draft row verified, each with its bytes (None: an end of generation).
    The executor samples the row after a draft token only while the token before equals it, is
    no end of generation and did not fire a lazy grammar; which of them the job keeps is the
    scheduler's rule (updates.py)."""

    rows: dict[int, list[tuple[int, bytes | None]]] = field(default_factory=dict)
    grammar_complete: set[int] = field(default_factory=set)  # after the job's only row (no drafts)
    rejected: dict[int, str] = field(default_factory=dict)  # the job's grammar had no way on: no rows
    # the job's lazy grammar fired at its last row: its draft is kept only that far, and it
    # drafts no more (lazy_trigger.py)
    triggered: set[int] = field(default_factory=set)
