"""Plain engine state for the scheduler and KV bookkeeper tests (no model, no llama.cpp)."""

from __future__ import annotations

from backends.contract.schema import GenerateRequest, Sampling, SamplingDefaults
from backends.llamacpp.kv import KvBookkeeper
from backends.llamacpp.scheduler import DecodeCall, Scheduler, StepPlan
from backends.llamacpp.state import ActiveJob


def sampling(max_tokens: int = 16) -> Sampling:
    return GenerateRequest(prompt="-", max_tokens=max_tokens, temperature=0.0).sampling(SamplingDefaults())


def prompt(n: int, first: int = 1000) -> list[int]:
    """n distinct token ids; two prompts share a prefix exactly where their ids agree."""
    return list(range(first, first + n))


def engine(*, slots: int = 16, prefix_cache: int = 4, n_batch: int = 512, n_ctx: int = 16384,
           n_ctx_per_seq: int = 4096, per_slot: bool = True, draft_max: int = 0) -> Scheduler:
    kv = KvBookkeeper(slots=slots, prefix_cache=prefix_cache, n_ctx=n_ctx, n_batch=n_batch,
                      per_slot=per_slot)
    return Scheduler(kv, n_batch=n_batch, n_ctx_per_seq=n_ctx_per_seq, draft_max=draft_max)


def admit(s: Scheduler, job_id: str, tokens: list[int], max_tokens: int = 16) -> list[ActiveJob]:
    s.enqueue(job_id, tokens, sampling(max_tokens))
    return s.start_waiting()


def execute(s: Scheduler, plan: StepPlan) -> None:
    """What the executor and engine do with a plan, minus llama.cpp: every call succeeds, a
    finished prompt samples token 7, a decoder stops after max_tokens."""
    for call in plan.calls:
        for job in call.decoders:
            job.n_past += 1
            _sampled(s, job)
        for job, count in call.prompts:
            job.n_past += count
            if job.n_past == len(job.tokens):
                _sampled(s, job)
    s.kv.take_ops()


def _sampled(s: Scheduler, job: ActiveJob) -> None:
    job.generated += 1
    job.output.append(7)
    job.next_token = 7
    if job.generated >= job.sampling.max_tokens:
        s.release(job)


def rows_of(call: DecodeCall) -> dict[int, int]:
    """Rows per sequence id in one call (its own rows, not the throw-away ones)."""
    rows = {job.seq_id: 1 for job in call.decoders}
    rows.update({job.seq_id: count for job, count in call.prompts})
    return rows
