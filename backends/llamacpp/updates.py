"""The per-step state updates, without llama.cpp: what the tokens a call sampled do to each job.

The executor decodes a `DecodeCall` and samples its rows (`Sampled`: a decoder's next token and
its verified draft rows, a finished prompt's first token). `Scheduler.update` then moves every
job on by the rules here (one function per job and no object per token: this runs for every
token of every job): prompt progress, draft acceptance, end of generation, stop strings, a
grammar's whole text, max_tokens and the context's last cell. What ended, and why, comes back
in a `CallUpdate` that the engine turns into events.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from backends.base import Event, Token
from backends.contract.schema import FinishReason
from backends.llamacpp.kv import KvOp
from backends.llamacpp.state import ActiveJob


@dataclass(slots=True)
class CallUpdate:
    """What one call changed: for the engine (events, samplers to read and close) and for the
    executor (KV operations to apply before the next call)."""

    events: list[Event] = field(default_factory=list)  # text deltas and failures, in order
    finished: list[ActiveJob] = field(default_factory=list)  # job.done says why; freed at the step's end
    released: list[int] = field(default_factory=list)  # sequence ids of jobs failed and freed now
    kv_ops: list[KvOp] = field(default_factory=list)  # rejected draft rows, failed jobs' KV


def advance(job: ActiveJob, rows: list[tuple[int, bytes | None]], draft: Sequence[int],
            grammar_complete: bool, n_ctx_per_seq: int, events: list[Event]) -> int:
    """Take a job's sampled rows (its n_past already counts the token it fed): the first, then
    each next one while the token before it is the draft token it verified (so the text is the
    one decoding one token at a time gives). A token ends the job (end of generation, a stop
    string, its grammar's text whole, max_tokens, its context's last cell) or is fed back next
    step. Returns how many draft tokens the job keeps; the caller drops the KV of the others."""
    kept = 0
    for token, piece in rows:
        if piece is None:  # end of generation: not part of the output
            finish(job, "stop", events)
            break
        job.generated += 1
        job.output.append(token)
        delta = job.text.feed(piece)
        if delta:
            events.append(Token(job.job_id, delta))
        if job.text.stopped or grammar_complete:
            finish(job, "stop", events)
            break
        if job.generated >= job.sampling.max_tokens or job.n_past + 1 >= n_ctx_per_seq:
            finish(job, "length", events)
            break
        job.next_token = token
        if kept == len(draft) or token != draft[kept]:
            break
        kept += 1
        job.n_past += 1  # the draft token's KV is already in place
    return kept


def finish(job: ActiveJob, reason: FinishReason, events: list[Event]) -> None:
    tail = job.text.finish()
    if tail:
        events.append(Token(job.job_id, tail, n_tokens=0))
    job.done = job.ended(reason)
    if job.text.stop_word is not None:
        job.done.extra["stop_word"] = job.text.stop_word
