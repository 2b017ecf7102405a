"""In-process llama.cpp: up to `slots` jobs decoded together in ONE context (continuous batching).

Each step() is one llama_decode over a batch that holds the next token of every decoding
sequence plus, within the token budget (n_batch), a chunk of each newcomer's prompt. So streams
keep producing tokens while a long prompt prefills, and new jobs join between steps.

KV layout (backend.batch_invariant):
- true (default): every sequence id has its own KV stream of n_ctx_per_seq cells and ggml runs
  batch-invariant kernels, so a job's greedy text is the same alone or in any batch. A slot's
  stream is its budget: admission only waits for a free slot.
- false: all slots share one unified pool of n_ctx cells. A job reserves prompt + max_tokens
  cells (capped by n_ctx_per_seq) when it starts; when the pool cannot hold it yet it waits in
  `_waiting` (admission deferred), it never evicts a running job.

Shared prefixes (a common system prompt): a newcomer copies the KV of the longest prompt prefix
it shares with a cached prefix or a running job (llama_memory_seq_cp) and prefills only the
rest. Copied prefixes are kept in a small LRU of spare sequence ids.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import llama_cpp as ll

from backends.base import Done, Event, Failed, JobRejected, Token
from backends.contract.schema import GenerateRequest, Sampling
from backends.llamacpp_invariance import FA_TILE_ROWS, SPLIT_KV_CELLS, reusable_prefix
from backends.llamacpp_model import LoadedModel
from backends.llamacpp_settings import LlamaCppSettings
from backends.text import TextAssembler

MIN_SHARED_PREFIX = 8  # tokens; below this copying a prefix's KV costs more than prefilling it
Row = tuple[int, int, int, bool]  # token, position, sequence id, wants logits


@dataclass
class JobSeq:
    """One running job's llama.cpp sequence and what the engine knows of it."""

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
    output: list[int] = field(default_factory=list)  # generated token ids (fed back into the KV)
    batch_index: int = -1  # where this sequence's logits are in the current batch
    done: Done | None = None


@dataclass
class PrefixEntry:
    seq_id: int
    tokens: list[int]  # in its KV
    n_prompt: int  # prompt length of the job that computed that KV (see llamacpp_invariance)


@dataclass
class EngineStats:
    steps: int = 0
    decode_calls: int = 0
    prompt_tokens_prefilled: int = 0
    prompt_tokens_reused: int = 0
    tokens_generated: int = 0
    decode_seconds: float = 0.0
    deferred_admissions: int = 0


class LlamaCppBackend:
    name = "llama-cpp"

    def __init__(self, settings: LlamaCppSettings, threads: int | None = None) -> None:
        self.settings = settings
        self.slots = settings.slots
        self.invariant = settings.batch_invariant
        self.n_batch = settings.n_batch
        n_prefix = settings.prefix_cache
        streams = self.slots + n_prefix
        if self.n_batch < streams:  # one decode step holds a row for every sequence id
            raise ValueError(f"backend.n_batch ({self.n_batch}) must be at least slots + prefix_cache "
                             f"({streams})")
        self.model = LoadedModel(
            settings.model_path,
            n_ctx=settings.n_ctx_per_seq * streams if self.invariant else settings.n_ctx,
            n_batch=self.n_batch,
            n_seq_max=streams,
            threads=threads,
            batch_invariant=self.invariant,
        )
        self.n_ctx = ll.llama_n_ctx(self.model.ctx)  # llama.cpp rounds streams up to 256 cells
        self.n_ctx_per_seq = min(settings.n_ctx_per_seq, ll.llama_n_ctx_seq(self.model.ctx))
        self._batch = ll.llama_batch_init(self.n_batch, 0, 1)
        self._free_seq_ids = list(range(self.slots))
        self._free_prefix_ids = list(range(self.slots, streams))
        self._prefixes: OrderedDict[int, PrefixEntry] = OrderedDict()  # LRU, oldest first
        # per-slot streams: a free slot keeps its last job's KV until the slot is reused, so a
        # job that repeats or continues it (the next turn of a chat) skips that prefill
        self._slot_kv: dict[int, PrefixEntry] = {}
        self._active: dict[str, JobSeq] = {}  # admission order = prefill order
        self._waiting: list[tuple[str, list[int], Sampling]] = []
        self._finished: list[Event] = []
        self._reserved = 0
        self._decoders_owed = False  # the last step ran newcomers only: decoders go next
        self.stats_ = EngineStats()

    # -- protocol -----------------------------------------------------------------------------

    def free_slots(self) -> int:
        return self.slots - len(self._active) - len(self._waiting)

    def probe(self) -> bool:
        """In process: the engine is there as long as this object is."""
        return True

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
            "decode_calls": s.decode_calls,
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
            seq = JobSeq(
                job_id=job_id,
                seq_id=self._take_seq_id(),
                tokens=tokens,
                sampling=sampling,
                chain=self.model.sampler_chain(sampling),
                text=TextAssembler(sampling.stop),
                reserved=need,
            )
            self._reserved += need
            self._reuse_prefix(seq)
            self._active[job_id] = seq

    def _take_seq_id(self) -> int:
        # lowest first: busy ids stay consecutive, so the decoders fill one ubatch (see _equal_rows)
        seq_id = min(self._free_seq_ids)
        self._free_seq_ids.remove(seq_id)
        return seq_id

    def _fits(self, need: int) -> bool:
        if self.invariant:
            return True  # each slot owns its KV stream
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

    def _reuse_prefix(self, seq: JobSeq) -> None:
        """Reuse the KV of the longest shared prefix instead of prefilling it: in place from what
        this slot's last job left, or copied from a prefix entry or a running job."""
        kept = self._slot_kv.pop(seq.seq_id, None)
        sources = [(e, "entry") for e in self._prefixes.values()]
        sources += [(e, "other slot") for e in self._slot_kv.values()]
        sources += [(PrefixEntry(o.seq_id, o.tokens[: o.n_past], len(o.tokens)), "running")
                    for o in self._active.values()]
        if kept is not None:
            sources.insert(0, (kept, "kept"))
        best_len, best, kind = 0, None, ""
        for source, source_kind in sources:
            # the last prompt token must run, for the first logits
            n = min(_common_prefix(source.tokens, seq.tokens), len(seq.tokens) - 1)
            if self.invariant:
                n = reusable_prefix(n, source.n_prompt, len(seq.tokens), self.n_batch)
            worth = 1 if source_kind == "kept" else MIN_SHARED_PREFIX  # in place any token pays
            if n >= worth and n > best_len:
                best_len, best, kind = n, source, source_kind
        mem = self.model.memory
        if best is None:
            if kept is not None:
                ll.llama_memory_seq_rm(mem, seq.seq_id, -1, -1)
            return
        if kind == "kept":
            ll.llama_memory_seq_rm(mem, seq.seq_id, best_len, -1)
        else:
            self._copy_prefix(best.seq_id, seq.seq_id, best_len)
        seq.n_past = best_len
        self.stats_.prompt_tokens_reused += best_len
        if kind == "entry":
            self._prefixes.move_to_end(best.seq_id)
        elif kind == "running" and (self._free_prefix_ids or self._evict_prefix()):
            # a prefix two live jobs share is likely shared by the next one too: keep it
            entry_id = self._free_prefix_ids.pop()
            self._copy_prefix(best.seq_id, entry_id, best_len)
            self._prefixes[entry_id] = PrefixEntry(entry_id, seq.tokens[:best_len], best.n_prompt)

    def _copy_prefix(self, src: int, dst: int, n_tokens: int) -> None:
        mem = self.model.memory
        if self.invariant:  # across streams llama.cpp copies a whole stream: copy, then cut
            ll.llama_memory_seq_cp(mem, src, dst, -1, -1)
            ll.llama_memory_seq_rm(mem, dst, n_tokens, -1)
        else:  # one pool: the cells just gain a sequence id
            ll.llama_memory_seq_cp(mem, src, dst, 0, n_tokens)

    def _release(self, seq: JobSeq, keep_kv: bool = True) -> None:
        """Free a finished/cancelled sequence's slot at once, and its KV cells (a per-slot stream
        keeps them for the slot's next job, see _slot_kv)."""
        if self.invariant and keep_kv:
            kv_tokens = (seq.tokens + seq.output)[: seq.n_past]
            self._slot_kv[seq.seq_id] = PrefixEntry(seq.seq_id, kv_tokens, len(seq.tokens))
        else:
            ll.llama_memory_seq_rm(self.model.memory, seq.seq_id, -1, -1)
        ll.llama_sampler_free(seq.chain)
        self._active.pop(seq.job_id, None)
        self._free_seq_ids.append(seq.seq_id)
        self._reserved -= seq.reserved
        if seq.done is not None:
            self._finished.append(seq.done)

    # -- one decode step ----------------------------------------------------------------------

    def _decode_step(self) -> list[Event]:
        events: list[Event] = []
        self.stats_.steps += 1
        decoding = [s for s in self._active.values() if s.next_token is not None]
        prefilling = [s for s in self._active.values() if s.next_token is None]
        if self.invariant:
            self._invariant_step(decoding, prefilling, events)
        else:
            self._pooled_step(decoding, prefilling, events)
        for s in [s for s in self._active.values() if s.done is not None]:
            self._release(s)
        events.extend(self._finished)
        self._finished = []
        return events

    def _pooled_step(self, decoding: list[JobSeq], prefilling: list[JobSeq], events: list[Event]) -> None:
        """One llama_decode: every decoder's next token plus prompt chunks, within n_batch tokens."""
        rows: list[Row] = []
        for s in decoding:
            s.batch_index = len(rows)
            rows.append(_decoder_row(s))
        budget = self.n_batch - len(rows)
        fed: list[tuple[JobSeq, int]] = []
        for s in prefilling:
            if budget <= 0:
                break
            chunk = s.tokens[s.n_past : s.n_past + budget]
            rows.extend(self._prompt_rows(s, len(chunk), offset=len(rows)))
            fed.append((s, len(chunk)))
            budget -= len(chunk)
        rc = self._decode(rows)
        if rc != 0:
            events.extend(self._fail_step(rc, decoding, [s for s, _ in fed]))
            return
        for s in decoding:
            s.n_past += 1
            self._sample(s, events)
        for s, count in fed:
            self._prefilled(s, count, events)

    def _invariant_step(self, decoding: list[JobSeq], prefilling: list[JobSeq],
                        events: list[Event]) -> None:
        """The same work as _pooled_step, split so that each row meets the same ggml kernels as if
        its job ran alone (see docs/ARCHITECTURE.md, "Determinism"): one llama_decode for the
        decoders, one for the short prompts that fit (under FA_TILE_ROWS tokens: row-by-row
        attention however they are split), then each other prompt's chunk in a llama_decode of
        its own, cut at multiples of n_batch whatever the load."""
        short, alone = self._pick_short(prefilling)
        # Newcomers first, in a step of their own, so their first token goes out one decoders'
        # call sooner (time to first token); the decoders then run in the next step, never later.
        newcomers_only = bool(short and decoding and not self._decoders_owed)
        self._decoders_owed = newcomers_only
        if newcomers_only:
            decoding, alone = [], []
        if decoding:
            rows, pads = self._equal_rows({s.seq_id: [_decoder_row(s)] for s in decoding}, decoding)
            if self._decode_shared(rows, pads, decoding, events):
                for s in decoding:
                    s.n_past += 1
                    self._sample(s, events)
        budget = self.n_batch - len(decoding)
        if short:
            rows, pads = self._equal_rows({s.seq_id: self._prompt_rows(s, len(s.tokens) - s.n_past)
                                           for s in short}, short)
            if self._decode_shared(rows, pads, short, events):
                for s in short:
                    self._prefilled(s, len(s.tokens) - s.n_past, events)
            budget -= len(rows)
        for s in alone:
            if budget <= 0:
                break
            count = min(len(s.tokens), (s.n_past // self.n_batch + 1) * self.n_batch) - s.n_past
            rc = self._decode(self._prompt_rows(s, count))
            if rc != 0:
                events.extend(self._fail_step(rc, [], [s]))
                continue
            self._prefilled(s, count, events)
            budget -= count

    def _pick_short(self, prefilling: list[JobSeq]) -> tuple[list[JobSeq], list[JobSeq]]:
        """Short prompts that fit one equal-width batch (see _equal_rows); the rest run alone."""
        short: list[JobSeq] = []
        alone: list[JobSeq] = []
        for s in prefilling:
            if len(s.tokens) < FA_TILE_ROWS:
                ids = [t.seq_id for t in short] + [s.seq_id]
                width = max(len(t.tokens) - t.n_past for t in (*short, s))
                if (max(ids) - min(ids) + 1) * width <= self.n_batch:
                    short.append(s)
                    continue
            alone.append(s)
        return short, alone

    def _equal_rows(self, members: dict[int, list[Row]],
                    seqs: list[JobSeq]) -> tuple[list[Row], list[tuple[int, int]]]:
        """One ubatch: llama.cpp cuts a per-stream batch into ubatches of consecutive sequence
        ids holding equally many rows each, and a row's kernels depend on its ubatch. So every
        id from the lowest to the highest gets the same number of rows, topped up with throw-away
        rows after its own (causal attention keeps them out of the real rows). A lone decoder
        past 256 cells gets a neighbour too, else ggml splits its KV scan across threads."""
        lo, hi = min(members), max(members)
        width = max(len(r) for r in members.values())
        if lo == hi and width == 1 and seqs[0].n_past + 1 > SPLIT_KV_CELLS // 2:
            if hi + 1 < self.slots + self.settings.prefix_cache:
                hi += 1
            elif lo > 0:
                lo -= 1  # (a single stream has no neighbour, but then every job runs alone)
        rows: list[Row] = []
        pads: list[tuple[int, int]] = []
        by_id = {s.seq_id: s for s in seqs}
        for seq_id in range(lo, hi + 1):
            own = members.get(seq_id, [])
            if own[-1:] and own[-1][3]:  # it wants logits: from the last of its own rows
                by_id[seq_id].batch_index = len(rows) + len(own) - 1
            rows.extend(own)
            pos = own[-1][1] + 1 if own else ll.llama_memory_seq_pos_max(self.model.memory, seq_id) + 1
            if len(own) < width:
                pads.append((seq_id, pos))
                rows.extend((0, pos + i, seq_id, False) for i in range(width - len(own)))
        return rows, pads

    def _decode_shared(self, rows: list[Row], pads: list[tuple[int, int]], seqs: list[JobSeq],
                       events: list[Event]) -> bool:
        rc = self._decode(rows)
        for seq_id, pos in pads:
            ll.llama_memory_seq_rm(self.model.memory, seq_id, pos, -1)
        if rc != 0:
            events.extend(self._fail_step(rc, seqs, []))
        return rc == 0

    def _prompt_rows(self, s: JobSeq, count: int, offset: int = 0) -> list[Row]:
        last = s.n_past + count == len(s.tokens)  # the prompt's last token yields the first logits
        s.batch_index = -1
        chunk = s.tokens[s.n_past : s.n_past + count]
        rows = [(tok, s.n_past + i, s.seq_id, False) for i, tok in enumerate(chunk)]
        if last:
            rows[-1] = (*rows[-1][:3], True)
            s.batch_index = offset + len(rows) - 1  # offset: rows already in this batch
        return rows

    def _prefilled(self, s: JobSeq, count: int, events: list[Event]) -> None:
        s.n_past += count
        self.stats_.prompt_tokens_prefilled += count
        if s.n_past == len(s.tokens):
            self._sample(s, events)

    def _decode(self, rows: list[Row]) -> int:
        batch = self._batch
        for i, (token, pos, seq_id, logits) in enumerate(rows):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq_id
            batch.logits[i] = logits
        batch.n_tokens = len(rows)
        t0 = time.perf_counter()
        rc = ll.llama_decode(self.model.ctx, batch)
        self.stats_.decode_seconds += time.perf_counter() - t0
        self.stats_.decode_calls += 1
        return int(rc)

    def _sample(self, s: JobSeq, events: list[Event]) -> None:
        tok = ll.llama_sampler_sample(s.chain, self.model.ctx, s.batch_index)
        if self.model.is_eog(tok):
            self._finish(s, "stop", events)
            return
        s.generated += 1
        s.output.append(tok)
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

    def _finish(self, s: JobSeq, reason: str, events: list[Event]) -> None:
        tail = "" if s.text.stopped else s.text.finish()
        if tail:
            events.append(Token(s.job_id, tail, n_tokens=0))
        s.done = Done(s.job_id, reason, len(s.tokens), s.generated)  # type: ignore[arg-type]

    def _fail_step(self, rc: int, decoding: list[JobSeq], fed: list[JobSeq]) -> list[Event]:
        # rc 1: no KV slot for the batch. Admission reserves cells, so this means the cache is
        # fragmented or over-committed: fail the newest prefilling job, keep the decoders.
        victims = fed[-1:] if rc == 1 and fed else [*decoding, *fed]
        why = "KV cache full" if rc == 1 else f"llama_decode failed (rc={rc})"
        events: list[Event] = []
        for s in victims:
            s.done = None
            self._release(s, keep_kv=False)
            events.append(Failed(s.job_id, f"{why}; job not completed", retryable=rc == 1))
        return events


def _decoder_row(s: JobSeq) -> Row:
    assert s.next_token is not None
    return (s.next_token, s.n_past, s.seq_id, True)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

