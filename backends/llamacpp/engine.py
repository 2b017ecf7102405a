"""In-process llama.cpp: up to `slots` jobs decoded together in ONE context (continuous batching).

`LlamaCppBackend` is the Backend protocol over three parts (see the package docstring): the
`Scheduler` plans each step, the `KvBookkeeper` tracks sequence ids and what their KV holds, the
`Executor` runs plans on llama.cpp. What is left here is the glue: tokenizing a request,
turning sampled tokens into events and the finish rules, and the engine's counters.

KV layout (backend.kv_unified):
- false (default): every sequence id has its own KV stream of n_ctx_per_seq cells. A slot's
  stream is its budget: admission only waits for a free slot. With backend.batch_invariant ggml
  also runs batch-invariant kernels, so a job's greedy text is the same alone or in any batch.
- true: all slots share one unified pool of n_ctx cells. A job reserves prompt + max_tokens
  cells (capped by n_ctx_per_seq) when it starts; when the pool cannot hold it yet it waits
  (admission deferred), it never evicts a running job.

Sliding-window layers (gemma 3: 5 of every 6) need only the last n_swa positions. Per-slot streams
keep just that window in those layers, as llama-server does (a 4,096-token slot then costs about
llama-server's memory, not twice it), and the bookkeeper reuses a prefix only while the window
before it is still held. The unified pool keeps them whole: there a prefix copy shares cells
between sequences, and llama.cpp never recycles a shared cell, so windowed layers could fill up.
Batch invariance keeps them whole too (a window recycles cells in an order that depends on the
batch, and the attention sums cells in cell order).
"""

from __future__ import annotations

import time

import llama_cpp as ll

from backends.base import Done, Event, Failed, JobRejected, Token
from backends.contract.schema import FinishReason, GenerateRequest
from backends.llamacpp.executor import Executor
from backends.llamacpp.kv import KvBookkeeper
from backends.llamacpp.model import LoadedModel
from backends.llamacpp.sampling import check_format
from backends.llamacpp.scheduler import DecodeCall, Scheduler, check_n_batch
from backends.llamacpp.state import ActiveJob
from backends.llamacpp_settings import LlamaCppSettings


def keeps_whole_window(settings: LlamaCppSettings) -> bool:
    """swa_full: keep sliding-window layers whole (see the module docstring)."""
    return settings.kv_unified or settings.batch_invariant


class LlamaCppBackend:
    name = "llama-cpp"

    def __init__(self, settings: LlamaCppSettings, threads: int | None = None) -> None:
        self.settings = settings
        self.slots = settings.slots
        self.per_slot = not settings.kv_unified
        self.n_batch = settings.n_batch
        streams = self.slots + settings.prefix_cache
        check_n_batch(self.n_batch, streams)  # before the model loads
        self.model = LoadedModel(
            settings.model_path,
            chat_template=settings.chat_template,
            n_ctx=settings.n_ctx_per_seq * streams if self.per_slot else settings.n_ctx,
            n_batch=self.n_batch,
            n_seq_max=streams,
            threads=threads,
            batch_invariant=settings.batch_invariant,
            kv_unified=settings.kv_unified,
            swa_full=keeps_whole_window(settings),
        )
        self.n_ctx = ll.llama_n_ctx(self.model.ctx)  # llama.cpp rounds streams up to 256 cells
        self.n_ctx_per_seq = min(settings.n_ctx_per_seq, ll.llama_n_ctx_seq(self.model.ctx))
        self.kv = KvBookkeeper(slots=self.slots, prefix_cache=settings.prefix_cache, n_ctx=self.n_ctx,
                               n_batch=self.n_batch, per_slot=self.per_slot,
                               invariant=settings.batch_invariant, window=self.model.n_swa,
                               pos_min=self._oldest_position)
        self.scheduler = Scheduler(self.kv, n_batch=self.n_batch, n_ctx_per_seq=self.n_ctx_per_seq,
                                   draft_max=settings.draft_max)
        self.executor = Executor(self.model, n_batch=self.n_batch, n_streams=streams,
                                 per_slot=self.per_slot)
        self._finished: list[Event] = []
        self.prompt_tokens_prefilled = 0
        self.tokens_generated = 0
        self.draft_tokens = 0  # proposed by prompt lookup (speculation.py) ...
        self.draft_accepted = 0  # ... and kept
        self.grammar_rejections = 0

    def _oldest_position(self, seq_id: int) -> int:
        """The oldest position a sequence's sliding-window layers still hold (-1: none)."""
        return int(ll.llama_memory_seq_pos_min(self.model.memory, seq_id))

    # -- protocol -----------------------------------------------------------------------------

    def free_slots(self) -> int:
        return self.scheduler.free_slots()

    def probe(self) -> bool:
        """In process: the engine is there as long as this object is."""
        return True

    def admit(self, job_id: str, request: GenerateRequest) -> None:
        if self.free_slots() <= 0:
            raise RuntimeError("no free slot")  # before tokenizing: the worker checks first
        tokens = self.model.prompt_tokens(request)
        sampling = request.sampling(self.settings.sampling)
        if sampling.format is not None:
            check_format(self.model, sampling.format)  # a schema that cannot compile fails now
        self.scheduler.enqueue(job_id, tokens, sampling)
        self._start_waiting()

    def cancel(self, job_id: str) -> None:
        if self.scheduler.cancel_waiting(job_id):
            self._finished.append(Done(job_id, "cancelled", 0, 0))
            return
        job = self.scheduler.active.get(job_id)
        if job is not None and job.done is None:
            job.done = Done(job_id, "cancelled", len(job.tokens), job.generated)
            self._release(job)

    def step(self, timeout: float = 0.0) -> list[Event]:
        events, self._finished = self._finished, []
        if not self.scheduler.active:
            self._start_waiting()
        if self.scheduler.active:
            events.extend(self._decode_step())
            self._start_waiting()  # slots freed this step go to waiting jobs at once
        elif timeout > 0 and not events:
            time.sleep(min(timeout, 0.01))
        return events

    def stats(self) -> dict[str, object]:
        return {
            "active": len(self.scheduler.active),
            "waiting": len(self.scheduler.waiting),
            "kv_reserved": self.kv.reserved,
            "kv_cells": self.n_ctx,
            "prefixes": len(self.kv.prefixes),
            "steps": self.scheduler.steps,
            "decode_calls": self.executor.decode_calls,
            "prompt_tokens_prefilled": self.prompt_tokens_prefilled,
            "prompt_tokens_reused": self.kv.reused_tokens,
            "tokens_generated": self.tokens_generated,
            "draft_tokens": self.draft_tokens,
            "draft_accepted": self.draft_accepted,
            "grammar_rejections": self.grammar_rejections,
            "deferred_admissions": self.scheduler.deferred_admissions,
            "decode_seconds": round(self.executor.decode_seconds, 3),
        }

    def close(self) -> None:
        for job in list(self.scheduler.active.values()):
            self._release(job)
        self.executor.close()
        self.model.close()

    # -- slots ----------------------------------------------------------------------------------

    def _start_waiting(self) -> None:
        started = self.scheduler.start_waiting()
        self.executor.apply(self.kv.take_ops())  # prefix copies, in the order they were decided
        for job in started:
            self.executor.open(job)

    def _release(self, job: ActiveJob, keep_kv: bool = True) -> None:
        """Free a finished/cancelled/failed job's slot at once (and its KV, see KvBookkeeper)."""
        self.scheduler.release(job, keep_kv)
        self.executor.close_sequence(job.seq_id)
        self.executor.apply(self.kv.take_ops())
        if job.done is not None:
            self._finished.append(job.done)

    # -- one step -------------------------------------------------------------------------------

    def _decode_step(self) -> list[Event]:
        events: list[Event] = []
        for call in self.scheduler.plan_step().calls:
            rc = self.executor.run(call)
            if rc != 0:
                self._fail(call, rc, events)
                continue
            if call.decoders and not call.prompts:  # what the draft budget weighs (speculation.py)
                self.scheduler.costs.record(call.n_rows(), call.decoder_rows(),
                                            self.executor.last_decode_seconds)
            for job in call.decoders:
                self._verify(job, call.drafts.get(job.seq_id, ()), events)
            for job, count in call.prompts:
                job.n_past += count
                self.prompt_tokens_prefilled += count
                if job.n_past == len(job.tokens):
                    self._sample(job, events)
        for job in [j for j in self.scheduler.active.values() if j.done is not None]:
            self._release(job)
        events.extend(self._finished)
        self._finished = []
        return events

    def _verify(self, job: ActiveJob, draft: list[int] | tuple[()], events: list[Event]) -> None:
        """A decoder's step: sample its next token; with a draft, keep sampling the draft rows
        while each draft token is what was sampled before it (so the text is the one decoding
        one token at a time gives), then drop the KV of the rows not kept."""
        job.n_past += 1
        self._sample(job, events)
        kept = 0
        while kept < len(draft) and job.done is None and job.next_token == draft[kept]:
            kept += 1
            job.n_past += 1  # the draft token's KV is already in place
            self._sample(job, events, kept)
        if draft:
            self.draft_tokens += len(draft)
            self.draft_accepted += kept
            if job.ngrams is not None:
                job.ngrams.record(len(draft), kept)
            if kept < len(draft):
                self.kv.drop_tail(job)
                self.executor.apply(self.kv.take_ops())

    def _sample(self, job: ActiveJob, events: list[Event], draft_index: int = 0) -> None:
        try:
            tok = self.executor.sample(job, draft_index)
        except JobRejected as e:  # its grammar has no way on
            job.done = None
            self._release(job, keep_kv=False)
            events.append(Failed(job.job_id, str(e)))
            return
        if self.model.is_eog(tok):
            self._finish(job, "stop", events)
            return
        job.generated += 1
        job.output.append(tok)
        self.tokens_generated += 1
        delta = job.text.feed(self.model.piece(tok))
        if delta:
            events.append(Token(job.job_id, delta))
        if job.text.stopped or self.executor.sampler(job).grammar_complete:
            self._finish(job, "stop", events)
        elif job.generated >= job.sampling.max_tokens or job.n_past + 1 >= self.n_ctx_per_seq:
            self._finish(job, "length", events)
        else:
            job.next_token = tok

    def _finish(self, job: ActiveJob, reason: FinishReason, events: list[Event]) -> None:
        tail = "" if job.text.stopped else job.text.finish()
        if tail:
            events.append(Token(job.job_id, tail, n_tokens=0))
        job.done = Done(job.job_id, reason, len(job.tokens), job.generated)
        sampler = self.executor.sampler(job)
        self.grammar_rejections += sampler.rejections
        if sampler.top_logprobs is not None:  # the end-of-generation token is not output
            job.done.extra["logprobs"] = sampler.logprobs[: job.generated]

    def _fail(self, call: DecodeCall, rc: int, events: list[Event]) -> None:
        why = "KV cache full" if rc == 1 else f"llama_decode failed (rc={rc})"
        for job in self.scheduler.failed(call, rc):
            job.done = None
            self._release(job, keep_kv=False)
            events.append(Failed(job.job_id, f"{why}; job not completed", retryable=rc == 1))
