"""Plain engine state for the scheduler and KV bookkeeper tests (no model, no llama.cpp), and
the real engine made to plan the same calls on any CPU (`deterministic`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from backends.contract.schema import GenerateRequest, Sampling, SamplingDefaults
from backends.llamacpp.kv import KvBookkeeper
from backends.llamacpp.scheduler import DecodeCall, Scheduler, StepPlan
from backends.llamacpp.state import ActiveJob, Sampled
from backends.llamacpp_settings import LlamaCppSettings

if TYPE_CHECKING:
    from backends.llamacpp import LlamaCppBackend

SAMPLED = 7  # what the stand-in model samples on every row
# the stand-in clock of `deterministic`: a call's seconds from its shape (about one 2-core CPU's)
CALL_SECONDS, ROW_SECONDS, LOGITS_ROW_SECONDS = 0.003, 0.0005, 0.0075


def sampling(max_tokens: int = 16) -> Sampling:
    return GenerateRequest(prompt="-", max_tokens=max_tokens, temperature=0.0).sampling(SamplingDefaults())


def prompt(n: int, first: int = 1000) -> list[int]:
    """n distinct token ids; two prompts share a prefix exactly where their ids agree."""
    return list(range(first, first + n))


def engine(*, slots: int = 16, prefix_cache: int = 4, n_batch: int = 512, n_ctx: int = 16384,
           n_ctx_per_seq: int = 4096, per_slot: bool = True, draft_max: int = 0,
           invariant: bool = False) -> Scheduler:
    kv = KvBookkeeper(slots=slots, prefix_cache=prefix_cache, n_ctx=n_ctx, n_batch=n_batch,
                      per_slot=per_slot, invariant=invariant)
    return Scheduler(kv, n_batch=n_batch, n_ctx_per_seq=n_ctx_per_seq, draft_max=draft_max)


def admit(s: Scheduler, job_id: str, tokens: list[int], max_tokens: int = 16) -> list[ActiveJob]:
    s.enqueue(job_id, tokens, sampling(max_tokens))
    return s.start_waiting()


def execute(s: Scheduler, plan: StepPlan, seconds: float = 0.0) -> None:
    """A step of a model that samples token 7 on every row, through the scheduler's own rules
    (Scheduler.update): what the executor does, minus llama.cpp. Every call succeeds."""
    for call in plan.calls:
        s.update(call, sampled_sevens(call), seconds)
    s.end_step()


def sampled_sevens(call: DecodeCall) -> Sampled:
    """What the stand-in model samples for one call."""
    sampled = Sampled()
    for job in _sampling(call):
        sampled.rows[job.seq_id] = _sevens(call.drafts.get(job.seq_id, ()))
    return sampled


def _sampling(call: DecodeCall) -> list[ActiveJob]:
    """The jobs with a logits row: the decoders and the prompts this call finishes."""
    return [*call.decoders, *(job for job, count in call.prompts if job.n_past + count == len(job.tokens))]


def _sevens(draft: list[int] | tuple[()]) -> list[tuple[int, bytes | None]]:
    """The next token, then a draft row for each draft token the row before matched."""
    n = 1
    while n <= len(draft) and draft[n - 1] == SAMPLED:
        n += 1
    return [(SAMPLED, b"x")] * n


def rows_of(call: DecodeCall) -> dict[int, int]:
    """Rows per sequence id in one call (its own rows, not the throw-away ones)."""
    rows = {job.seq_id: 1 for job in call.decoders}
    rows.update({job.seq_id: count for job, count in call.prompts})
    return rows


def deterministic(threads: int | None = 2, **settings: Any) -> LlamaCppBackend:
    """The real engine whose decode calls do not follow this CPU's speed or load: no pacing
    (max_stall_ms 0; pacing cuts prefill chunks by measured step times) and `fixed_clock`. The
    same jobs then make the same calls, and the same counts, on any machine. For tests whose
    subject is not pacing."""
    from backends.llamacpp import LlamaCppBackend

    engine = LlamaCppBackend(LlamaCppSettings(**{"max_stall_ms": 0, **settings}), threads=threads)
    fixed_clock(engine)
    return engine


def fixed_clock(engine: LlamaCppBackend) -> None:
    """A stand-in clock for the times the engine's scheduler learns from: a call's seconds from its
    shape, not from this CPU (draft lengths weigh StepCosts, timed per call shape; a newcomers'
    step is weighed against the decoders' call)."""
    executor = engine.executor
    run = executor.run

    def timed(call: DecodeCall) -> int:
        rc = run(call)
        executor.last_decode_seconds = (CALL_SECONDS + ROW_SECONDS * call.n_rows()
                                        + LOGITS_ROW_SECONDS * call.decoder_rows())
        return rc

    executor.run = timed  # type: ignore[method-assign]
