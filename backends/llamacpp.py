"""In-process llama.cpp: up to `slots` jobs decoded together in ONE context (continuous batching).

Each step() is one llama_decode over a batch that holds the next token of every decoding
sequence plus, within the token budget (n_batch), a chunk of each newcomer's prompt. So streams
keep producing tokens while a long prompt prefills, and new jobs join between steps.

KV budget: all slots share one unified KV cache of n_ctx cells. A job reserves
prompt + max_tokens cells (capped by n_ctx_per_seq) when it starts; when the cache cannot hold
it yet, it waits in `_waiting` (admission deferred), it never evicts a running job.

Shared prefixes (a common system prompt): a newcomer copies the KV of the longest prompt prefix
it shares with a cached prefix or a running job (llama_memory_seq_cp, free in a unified cache)
and prefills only the rest. Copied prefixes are kept in a small LRU of spare sequence ids.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import llama_cpp as ll

from backends.base import Done, Event, Failed, GenerateRequest, JobRejected, Sampling, Token
from backends.llamacpp_model import LoadedModel
from backends.text import TextAssembler
from worker.settings import BackendSettings

MIN_SHARED_PREFIX = 16  # tokens; below this a copy is not worth the bookkeeping


@dataclass
class Sequence:
    job_id: str
    seq_id: int
    tokens: list[int]  # the prompt
    sampling: Sampling
    chain: ll.llama_sampler_p
    text: TextAssembler
    reserved: int  # KV cells reserved for this job
    n_past: int = 0  # tokens already in the KV cache
    next_token: int | None = None  # sampled, not yet fed back
    generated: int = 0
    batch_index: int = -1  # where this sequence's logits are in the current batch
    done: Done | None = None


@dataclass
class PrefixEntry:
    seq_id: int
    tokens: list[int]


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens_prefilled: int = 0
    prompt_tokens_reused: int = 0
    tokens_generated: int = 0
    decode_seconds: float = 0.0
    deferred_admissions: int = 0


class LlamaCppBackend:
    name = "llama-cpp"

    def __init__(self, settings: BackendSettings, threads: int | None = None) -> None:
        self.settings = settings
        self.slots = settings.slots
        self.n_ctx = settings.n_ctx
        self.n_ctx_per_seq = min(settings.n_ctx_per_seq, settings.n_ctx)
        self.n_batch = settings.n_batch
        n_prefix = settings.prefix_cache
        self.model = LoadedModel(
            settings.model_path,
            n_ctx=self.n_ctx,
            n_batch=self.n_batch,
            n_seq_max=self.slots + n_prefix + 1,  # + a scratch sequence for batch padding
            threads=threads,
        )
        self._batch = ll.llama_batch_init(self.n_batch, 0, 1)
        self._free_seq_ids = list(range(self.slots))
        self._free_prefix_ids = list(range(self.slots, self.slots + n_prefix))
        self._pad_seq = self.slots + n_prefix
        self._prefixes: OrderedDict[int, PrefixEntry] = OrderedDict()  # LRU, oldest first
        self._active: dict[str, Sequence] = {}  # admission order = prefill order
        self._waiting: list[tuple[str, list[int], Sampling]] = []
        self._finished: list[Event] = []
        self._reserved = 0
        self.stats_ = EngineStats()

    # -- protocol -----------------------------------------------------------------------------

    def free_slots(self) -> int:
        return self.slots - len(self._active) - len(self._waiting)

    def admit(self, job_id: str, request: GenerateRequest) -> None:
        if self.free_slots() <= 0:
            raise RuntimeError("no free slot")  # the worker checks free_slots() first
        tokens = self.model.prompt_tokens(request)
        sampling = request.sampling(self.settings.sampling)
        if len(tokens) + 1 > self.n_ctx_per_seq:
            raise JobRejected(
                f"prompt is {len(tokens)} tokens; the context holds {self.n_ctx_per_seq} per job "
                f"(backend.n_ctx_per_seq)"
            )
        self._waiting.append((job_id, tokens, sampling))
        self._start_waiting()

    def cancel(self, job_id: str) -> None:
        for i, waiting in enumerate(self._waiting):
            if waiting[0] == job_id:
                del self._waiting[i]
                self._finished.append(Done(job_id, "cancelled", 0, 0))
                return
        seq = self._active.get(job_id)
        if seq is not None and seq.done is None:
            seq.done = Done(job_id, "cancelled", len(seq.tokens), seq.generated)
            self._release(seq)

    def step(self, timeout: float = 0.0) -> list[Event]:
        events, self._finished = self._finished, []
        if not self._active:
            self._start_waiting()
        if self._active:
            events.extend(self._decode_step())
            self._start_waiting()  # slots freed this step go to waiting jobs at once
        elif timeout > 0 and not events:
            time.sleep(min(timeout, 0.01))
        return events

    def stats(self) -> dict[str, object]:
        s = self.stats_
        return {
            "active": len(self._active),
            "waiting": len(self._waiting),
            "kv_reserved": self._reserved,
            "kv_cells": self.n_ctx,
            "prefixes": len(self._prefixes),
            "steps": s.steps,
            "prompt_tokens_prefilled": s.prompt_tokens_prefilled,
            "prompt_tokens_reused": s.prompt_tokens_reused,
            "tokens_generated": s.tokens_generated,
            "deferred_admissions": s.deferred_admissions,
            "decode_seconds": round(s.decode_seconds, 3),
        }

    def close(self) -> None:
        for seq in list(self._active.values()):
            self._release(seq)
        ll.llama_batch_free(self._batch)
        self.model.close()

    # -- admission ----------------------------------------------------------------------------

    def _start_waiting(self) -> None:
        while self._waiting and self._free_seq_ids:
            job_id, tokens, sampling = self._waiting[0]
            need = min(len(tokens) + sampling.max_tokens, self.n_ctx_per_seq)
            while not self._fits(need) and self._evict_prefix():
                pass
            if not self._fits(need):
                self.stats_.deferred_admissions += 1
                return  # running jobs will free KV cells; the job keeps its place in line
            self._waiting.pop(0)
            seq = Sequence(
                job_id=job_id,
                seq_id=self._free_seq_ids.pop(0),
                tokens=tokens,
                sampling=sampling,
                chain=self.model.sampler_chain(sampling),
                text=TextAssembler(sampling.stop),
                reserved=need,
            )
            self._reserved += need
            self._reuse_prefix(seq)
            self._active[job_id] = seq

    def _fits(self, need: int) -> bool:
        # admit() capped `need` at n_ctx_per_seq <= n_ctx, so an idle engine always fits a job
        return self._reserved + need + self._prefix_cells() <= self.n_ctx

    def _prefix_cells(self) -> int:
        return sum(len(p.tokens) for p in self._prefixes.values())

    def _evict_prefix(self) -> bool:
        if not self._prefixes:
            return False
        seq_id, _ = self._prefixes.popitem(last=False)
        ll.llama_memory_seq_rm(self.model.memory, seq_id, -1, -1)
        self._free_prefix_ids.append(seq_id)
        return True

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Copy the KV of the longest shared prompt prefix instead of prefilling it."""
        best_len, best_src, from_entry = 0, -1, False
        for entry in self._prefixes.values():
            n = _common_prefix(entry.tokens, seq.tokens)
            if n > best_len:
                best_len, best_src, from_entry = n, entry.seq_id, True
        for other in self._active.values():
            n = min(_common_prefix(other.tokens, seq.tokens), other.n_past)
            if n > best_len:
                best_len, best_src, from_entry = n, other.seq_id, False
        best_len = min(best_len, len(seq.tokens) - 1)  # the last prompt token must run for logits
        if best_len < MIN_SHARED_PREFIX:
            return
        mem = self.model.memory
        ll.llama_memory_seq_cp(mem, best_src, seq.seq_id, 0, best_len)
        seq.n_past = best_len
        self.stats_.prompt_tokens_reused += best_len
        if from_entry:
            self._prefixes.move_to_end(best_src)
        elif self._free_prefix_ids or self._evict_prefix():
            # a prefix two live jobs share is likely shared by the next one too: keep it
            entry_id = self._free_prefix_ids.pop()
            ll.llama_memory_seq_cp(mem, best_src, entry_id, 0, best_len)
            self._prefixes[entry_id] = PrefixEntry(entry_id, seq.tokens[:best_len])

    def _release(self, seq: Sequence) -> None:
        """Free a finished/cancelled sequence's KV cells and slot at once."""
        ll.llama_memory_seq_rm(self.model.memory, seq.seq_id, -1, -1)
        ll.llama_sampler_free(seq.chain)
        self._active.pop(seq.job_id, None)
        self._free_seq_ids.append(seq.seq_id)
        self._reserved -= seq.reserved
        if seq.done is not None:
            self._finished.append(seq.done)

    # -- one decode step ----------------------------------------------------------------------

    def _decode_step(self) -> list[Event]:
        batch = self._batch
        n = 0

        def add(token: int, pos: int, seq_id: int, logits: bool) -> None:
            nonlocal n
            batch.token[n] = token
            batch.pos[n] = pos
            batch.n_seq_id[n] = 1
            batch.seq_id[n][0] = seq_id
            batch.logits[n] = logits
            n += 1

        decoding = [s for s in self._active.values() if s.next_token is not None]
        for s in decoding:
            s.batch_index = n
            add(s.next_token, s.n_past, s.seq_id, True)  # type: ignore[arg-type]
        prefilling = [s for s in self._active.values() if s.next_token is None]
        budget = self.n_batch - n
        fed: list[tuple[Sequence, int]] = []
        for s in prefilling:
            if budget <= 0:
                break
            chunk = s.tokens[s.n_past : s.n_past + budget]
            last = s.n_past + len(chunk) == len(s.tokens)
            for i, tok in enumerate(chunk):
                add(tok, s.n_past + i, s.seq_id, last and i == len(chunk) - 1)
            s.batch_index = n - 1 if last else -1
            fed.append((s, len(chunk)))
            budget -= len(chunk)
        # Pad to a multiple of 4 rows: llama.cpp's CPU matmul takes a 4-row kernel for full groups
        # of 4 and a 1-row kernel for the rest, which round differently. Padding puts every row
        # through the same kernel, so a sequence's tokens do not depend on its batch position.
        # A lone row has no neighbour to differ from: no padding, so one user decodes at full speed.
        for i in range(-n % 4 if n > 1 else 0):
            add(0, i, self._pad_seq, False)
        batch.n_tokens = n

        t0 = time.perf_counter()
        rc = ll.llama_decode(self.model.ctx, batch)
        ll.llama_memory_seq_rm(self.model.memory, self._pad_seq, -1, -1)
        self.stats_.decode_seconds += time.perf_counter() - t0
        self.stats_.steps += 1
        if rc != 0:
            return self._fail_step(rc, decoding, [s for s, _ in fed])

        for s, count in fed:
            s.n_past += count
            self.stats_.prompt_tokens_prefilled += count
        for s in decoding:
            s.n_past += 1
        events: list[Event] = []
        for s in [*decoding, *(s for s, _ in fed if s.batch_index >= 0)]:
            self._sample(s, events)
        for s in [s for s in self._active.values() if s.done is not None]:
            self._release(s)
        events.extend(self._finished)
        self._finished = []
        return events

    def _sample(self, s: Sequence, events: list[Event]) -> None:
        tok = ll.llama_sampler_sample(s.chain, self.model.ctx, s.batch_index)
        if self.model.is_eog(tok):
            self._finish(s, "stop", events)
            return
        s.generated += 1
        self.stats_.tokens_generated += 1
        delta = s.text.feed(self.model.piece(tok))
        if delta:
            events.append(Token(s.job_id, delta))
        if s.text.stopped:
            self._finish(s, "stop", events)
        elif s.generated >= s.sampling.max_tokens or s.n_past + 1 >= self.n_ctx_per_seq:
            self._finish(s, "length", events)
        else:
            s.next_token = tok

    def _finish(self, s: Sequence, reason: str, events: list[Event]) -> None:
        tail = "" if s.text.stopped else s.text.finish()
        if tail:
            events.append(Token(s.job_id, tail, n_tokens=0))
        s.done = Done(s.job_id, reason, len(s.tokens), s.generated)  # type: ignore[arg-type]

    def _fail_step(self, rc: int, decoding: list[Sequence], fed: list[Sequence]) -> list[Event]:
        # rc 1: no KV slot for the batch. Admission reserves cells, so this means the cache is
        # fragmented or over-committed: fail the newest prefilling job, keep the decoders.
        victims = fed[-1:] if rc == 1 and fed else [*decoding, *fed]
        why = "KV cache full" if rc == 1 else f"llama_decode failed (rc={rc})"
        events: list[Event] = []
        for s in victims:
            s.done = None
            self._release(s)
            events.append(Failed(s.job_id, f"{why}; job not completed", retryable=rc == 1))
        return events


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

