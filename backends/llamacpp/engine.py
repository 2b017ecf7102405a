"""In-process llama.cpp: up to `slots` jobs decoded together in ONE context (continuous batching).

`LlamaCppBackend` is the Backend protocol over three parts (see the package docstring): the
`Scheduler` plans each step and moves the jobs on by what it sampled (finish rules, drafts), the
`KvBookkeeper` tracks sequence ids and what their KV holds, the `Executor` runs plans on
llama.cpp. Calls go one way: engine -> scheduler -> bookkeeper, engine -> executor. What is left
here is the glue: tokenizing a request, plan -> executor -> scheduler.update, and the events.

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

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

import llama_cpp as ll
import psutil

from backends.base import Done, Embedding, Event, Failed, Scores
from backends.contract import tools
from backends.contract.schema import DEFAULT_TENANT, GenerateRequest, Sampling
from backends.contract.text_ops import TextRequest
from backends.llamacpp import text_ops
from backends.llamacpp.dialect import ModelDialect
from backends.llamacpp.embedding import EmbeddingContext
from backends.llamacpp.executor import Executor
from backends.llamacpp.kv import MIN_STASH_TOKENS, KvBookkeeper, PrefixEntry
from backends.llamacpp.kv_store import Header, KvStore, Read, StoreReader, StoreWriter
from backends.llamacpp.model import LoadedModel, load_weights
from backends.llamacpp.sampling import check_format, check_logit_bias, compile_dialect, grammar_takes
from backends.llamacpp.scheduler import Scheduler, check_n_batch
from backends.llamacpp.scoring import ScoringContext
from backends.llamacpp.state import WaitingJob
from backends.llamacpp.thought_budget import thinking_off
from backends.llamacpp.updates import CallUpdate
from backends.llamacpp_settings import LlamaCppSettings, kv_store_section
from backends.model import file_digest
from backends.model_card import capabilities, gguf_card

log = logging.getLogger(__name__)

# at close (a model unload, a worker's drain) the KV store's writer finishes what is queued for
# at most this long: a few entries of MBs each, on a local disk
STORE_FLUSH_SECONDS = 10.0
# an idle engine waits this long at most for the KV store's reads of jobs that arrived together
# before it starts those already ready: they then prefill their new turns in one step (a solo
# first step would make the others wait for it: a restart's queue of returning chats)
GATHER_READS_SECONDS = 0.25


def keeps_whole_window(settings: LlamaCppSettings) -> bool:
    """swa_full: keep sliding-window layers whole (see the module docstring)."""
    return settings.kv_unified or settings.batch_invariant


def ram_budget(settings: LlamaCppSettings) -> int:
    """Bytes of finished sequences' state kept in host RAM: the setting, else an eighth of the
    host's memory, at most 8 GiB (llama-server's --cache-ram default)."""
    if settings.cache_ram_mib is not None:
        return settings.cache_ram_mib << 20
    return min(8 << 30, psutil.virtual_memory().total // 8)


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
            chat_template_file=settings.chat_template_file,
            jinja=settings.jinja,
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
        self.executor = Executor(self.model, n_batch=self.n_batch, n_streams=streams,
                                 per_slot=self.per_slot)
        self.store, self._writer, self._reader = self._open_store(streams)
        self.kv, self.scheduler = self._bookkeeping()
        self.dialect = ModelDialect(self.model, settings.tool_format)
        self.executor.thought = self.dialect.thought
        self._finished: list[Event] = []
        self.grammar_rejections = 0
        self.faults = 0
        self.embed_batch = settings.embed_batch
        if settings.embed_model_path is not None and not settings.embed_model_path.exists():
            raise FileNotFoundError(f"embedding model file not found: {settings.embed_model_path}")
        self._embedding: EmbeddingContext | None = None  # made at the first embedding job
        self.embedded_inputs = 0
        self.score_batch = settings.rerank_batch
        self._scoring: ScoringContext | None = None  # made at the first rerank job
        self.scored_documents = 0
        self.score_prefilled = 0  # tokens the scoring context decoded (shared prefixes once)

    def _bookkeeping(self) -> tuple[KvBookkeeper, Scheduler]:
        settings = self.settings
        kv = KvBookkeeper(slots=self.slots, prefix_cache=settings.prefix_cache, n_ctx=self.n_ctx,
                          n_batch=self.n_batch, per_slot=self.per_slot, invariant=settings.batch_invariant,
                          window=self.model.n_swa, checkpoints=settings.checkpoints,
                          ram_budget=ram_budget(settings),
                          persist_min=settings.kv_store.min_tokens if self.store is not None else 0)
        self.executor.stash_sizes = kv.stash_sizes  # the RAM budget weighs what was stored
        return kv, Scheduler(kv, n_batch=self.n_batch, n_ctx_per_seq=self.n_ctx_per_seq,
                             draft_max=settings.draft_max, max_stall_ms=settings.max_stall_ms,
                             max_prefill_slowdown=settings.max_prefill_slowdown)

    def _open_store(self, streams: int) -> tuple[KvStore | None, StoreWriter | None, StoreReader | None]:
        """The KV store (kv_store.py) when kv_store.path is set, for per-slot streams (the layout
        whose finished KV a slot keeps, and the RAM cache stashes)."""
        cfg = kv_store_section(self.settings)
        if cfg is None or cfg.path is None:
            return None, None, None
        store = KvStore(cfg.path, self.identity(streams), budget_bytes=cfg.budget_mb << 20, fsync=cfg.fsync)
        writer = StoreWriter(store)
        self.executor.persist = writer.put
        return store, writer, StoreReader(store)

    def identity(self, streams: int) -> dict[str, object]:
        """What a stored state is valid for: this model file, the context settings that shape a
        sequence's state, this llama.cpp build. An entry restores only where all are equal."""
        path = Path(self.model.path)
        cparams = ll.llama_context_default_params()  # what LoadedModel leaves at llama.cpp's default
        return {"model_bytes": path.stat().st_size, "model_sha256": file_digest(path),
                "llama_cpp": ll.__version__, "n_ctx_seq": int(ll.llama_n_ctx_seq(self.model.ctx)),
                "n_seq_max": streams, "kv_unified": self.settings.kv_unified,
                "swa_full": keeps_whole_window(self.settings), "n_swa": self.model.n_swa,
                "batch_invariant": self.settings.batch_invariant, "flash_attn": int(cparams.flash_attn_type),
                "type_k": int(cparams.type_k), "type_v": int(cparams.type_v)}

    def _enqueue(self, job_id: str, tokens: list[int], sampling: Sampling, request: GenerateRequest,
                 resumed: int = 0) -> None:
        tenant = request.tenant or DEFAULT_TENANT
        waiting = self.scheduler.enqueue(job_id, tokens, sampling, resumed, tenant)
        if self._reader is not None:
            self._ask_store(waiting)
        if self.scheduler.active or not self._gathering_reads():
            self._guarded(self._start_waiting)

    def _ask_store(self, waiting: WaitingJob) -> None:
        """Look for more of the job's tokens in the store than the engine's KV holds (by
        MIN_STASH_TOKENS), on the reader's thread: the job waits (`reading`), the steps go on."""
        assert self._reader is not None
        kv, tokens = self.kv, waiting.tokens
        have = kv.longest_reusable(tokens, self.scheduler.active.values(), len(tokens), waiting.tenant)
        if have + MIN_STASH_TOKENS >= len(tokens):
            return  # no entry could give more (a short prompt, or one held here): no read at all

        def usable(h: Header) -> int:  # the bookkeeper's settings only: safe on the reader's thread
            return kv.reusable_stored(h.tokens, h.n_prompt, h.oldest, (p for p, _ in h.checkpoints), tokens)

        waiting.reading, waiting.reading_since = True, time.perf_counter()
        self._reader.submit(Read(waiting, waiting.tenant, tokens, usable, have + MIN_STASH_TOKENS))

    def _gathering_reads(self) -> bool:
        """Are store reads of waiting jobs still under way, the oldest for less than
        GATHER_READS_SECONDS? (an idle engine starts its ready jobs once they are not)"""
        since = [w.reading_since for w in self.scheduler.waiting if w.reading]
        return bool(since) and time.perf_counter() - min(since) < GATHER_READS_SECONDS

    def _take_reads(self) -> None:
        """Reads the reader finished: an entry found becomes a RAM entry the job reuses
        (kv.reuse_prefix) and the job may start. A job that left meanwhile (cancelled, or handed
        back by a fault) is not waited for: its entry is dropped."""
        if self._reader is None:
            return
        for read in self._reader.done():
            waiting = read.job
            assert isinstance(waiting, WaitingJob)
            waiting.reading, waiting.store_ms = False, read.ms
            if read.found is None or not any(w is waiting for w in self.scheduler.waiting):
                continue
            entry = read.found[0]
            size = len(entry.state) + sum(len(d) for _, d in entry.checkpoints)
            key = self.kv.adopt(PrefixEntry(0, entry.tokens, entry.n_prompt, waiting.tenant), entry.oldest,
                                [p for p, _ in entry.checkpoints], size)
            self.executor.hold(key, entry)

    # -- protocol -----------------------------------------------------------------------------

    def free_slots(self) -> int:
        return self.scheduler.free_slots()

    def speaks(self, request: GenerateRequest) -> bool:
        return self.dialect.speaks(request)

    def probe(self) -> bool:
        """In process: the engine is there as long as this object is."""
        return True

    def admit(self, job_id: str, request: GenerateRequest) -> None:
        if self.free_slots() <= 0:
            raise RuntimeError("no free slot")  # before tokenizing: the worker checks first
        request = thinking_off(request)
        tokens = self.model.prompt_tokens(request)
        sampling = request.sampling(self.settings.sampling)
        if (dialect := self.dialect.of(request, tokens)) is not None:
            sampling = replace(sampling, dialect=dialect)
        check_logit_bias(self.model, sampling)
        if sampling.format is not None:
            check_format(self.model, sampling.format)  # a schema that cannot compile fails now
        elif dialect is not None and dialect.gbnf is not None:
            ll.llama_sampler_free(compile_dialect(self.model, dialect))
        self._enqueue(job_id, tokens, sampling, request)

    def resume(self, job_id: str, request: GenerateRequest, delivered: str) -> bool:
        """Start a job again where a dead attempt left it: the prompt, then the text that attempt
        delivered, prefilled as one prompt (prefix reuse applies), counted as output already
        generated (max_tokens, usage), and generation goes on from there; a grammar (structured
        output) is fed the same tokens first. False (the caller starts it over) when the text
        already used max_tokens, or its tokens are not the grammar's, or it is answer JSON read
        from the model's own dialect (not the text the model wrote)."""
        if self.free_slots() <= 0:
            raise RuntimeError("no free slot")
        if tools.answers_in_json(request) and self.dialect.speaks(request):
            return False  # its stream holds the answer JSON read from the text, not the text
        request = thinking_off(request)
        sampling = request.sampling(self.settings.sampling)
        check_logit_bias(self.model, sampling)
        more = self.model.tokenize(delivered, special=False, add_special=False)
        if not more or len(more) >= sampling.max_tokens:
            return False
        if sampling.format is not None and not grammar_takes(self.model, sampling.format, more):
            return False
        self._enqueue(job_id, self.model.prompt_tokens(request) + more, sampling, request, resumed=len(more))
        return True

    def embed(self, texts: Sequence[str], truncate: Sequence[bool]) -> list[Embedding]:
        """Embeddings from a context of their own (backends/llamacpp/embedding.py)."""
        if self._embedding is None:
            path = self.settings.embed_model_path
            self._embedding = EmbeddingContext(
                load_weights(path) if path else self.model.model, owns_model=path is not None,
                n_ctx=self.settings.embed_n_ctx, n_batch=self.settings.embed_n_batch,
                n_seq=self.embed_batch, threads=self.model.threads)
        out = self._embedding.embed(texts, truncate)
        self.embedded_inputs += len(out)
        return out

    def score(self, query: str, instruction: str, documents: Sequence[str]) -> Scores:
        """Rerank scores from a context of their own (backends/llamacpp/scoring.py)."""
        if self._scoring is None:
            self._scoring = ScoringContext(self.model, n_ctx=self.settings.rerank_n_ctx,
                                           n_batch=self.n_batch, n_seq=self.score_batch)
        out = self._scoring.score(query, instruction, documents)
        self.scored_documents += len(documents)
        self.score_prefilled += out.prefilled
        return out

    def text_op(self, request: TextRequest) -> dict[str, object]:
        """Tokenize, detokenize or render a chat (backends/llamacpp/text_ops.py): the vocabulary
        and the template only, no decode. It runs on a thread beside the steps, on a core the
        decode leaves it."""
        with self.executor.lending_a_core():
            return text_ops.answer(self.model, request)

    def cancel(self, job_id: str) -> None:
        if self.scheduler.cancel_waiting(job_id):
            self._finished.append(Done(job_id, "cancelled", 0, 0))
            return
        job = self.scheduler.active.get(job_id)
        if job is not None and job.done is None:
            job.done = job.ended("cancelled")
            self.scheduler.release(job)  # its KV operations go with the next plan
            self.executor.close_sequence(job.seq_id)
            self._finished.append(job.done)

    def step(self, timeout: float = 0.0) -> list[Event]:
        self._guarded(self._step)
        events, self._finished = self._finished, []
        if not events and not self.scheduler.active and timeout > 0:
            time.sleep(min(timeout, 0.01))
        return events

    def _step(self) -> None:
        self._take_reads()
        if not self.scheduler.active and not self._gathering_reads():
            self._start_waiting()
        if self.scheduler.active:
            self._decode_step(self._finished)
            self._start_waiting()  # slots freed this step go to waiting jobs at once
        if self._writer is not None and not self.scheduler.active:
            # the last jobs' KV goes to the store now, not with the next job's plan: a worker
            # that idles, then is killed, has stored it
            self.executor.apply(self.kv.take_ops())

    def _guarded(self, work: Callable[[], None]) -> None:
        """An exception out of the engine's own work is a fault (a bug some mix of jobs met),
        not one job's: the KV and the bookkeeping no longer agree. Every job in the engine fails
        retryably (the worker hands each back for another attempt; one already finished ends as
        it did) and the engine starts clean: empty KV, no cached prefixes, no RAM entries."""
        try:
            work()
        except Exception:
            old_kv, old = self.kv, self.scheduler
            log.exception("engine fault; its %d jobs are handed back", len(old.active) + len(old.waiting))
            kv, scheduler = self._bookkeeping()
            kv.carry_counters(old_kv)  # before the stats (read by the heartbeat) see them
            scheduler.carry_counters(old)
            self.executor.clear()
            self.kv, self.scheduler = kv, scheduler
            self.faults += 1
            why = "engine fault: handed back"
            for job in old.active.values():
                self._finished.append(job.done or Failed(job.job_id, why, retryable=True))
            self._finished += [Failed(w.job_id, why, retryable=True) for w in old.waiting]

    def model_card(self) -> dict[str, object]:
        m = self.model
        return gguf_card(m.metadata(), path=Path(m.path), n_params=int(ll.llama_model_n_params(m.model)),
                         template=m.template_text(), defaults=self.settings.sampling,
                         capabilities=capabilities(thinking=self.dialect.thinking))

    def stats(self) -> dict[str, object]:
        return {
            "active": len(self.scheduler.active),
            "waiting": len(self.scheduler.waiting),
            "kv_reserved": self.kv.reserved,
            "kv_cells": self.n_ctx,
            "prefixes": len(self.kv.prefixes),
            "steps": self.scheduler.steps,
            "decode_calls": self.executor.decode_calls,
            "prompt_tokens_prefilled": self.scheduler.prompt_tokens_prefilled,
            "prompt_tokens_reused": self.kv.reused_tokens,
            "checkpoint_reuses": self.kv.checkpoint_reuses,
            "checkpoint_bytes": self.executor.checkpoint_bytes(),
            "ram_entries": len(self.kv.ram),
            "ram_bytes": self.kv.ram_bytes(),
            "ram_budget": self.kv.ram_budget,
            "ram_reuses": self.kv.ram_reuses,
            "tokens_generated": self.scheduler.tokens_generated,
            "draft_tokens": self.scheduler.draft_tokens,
            "draft_accepted": self.scheduler.draft_accepted,
            "grammar_rejections": self.grammar_rejections,
            "deferred_admissions": self.scheduler.deferred_admissions,
            "decode_seconds": round(self.executor.decode_seconds, 3),
            "embedded_inputs": self.embedded_inputs,
            "scored_documents": self.scored_documents,
            "score_prefilled": self.score_prefilled,
            "faults": self.faults,
            **self._store_stats(),
        }

    def _store_stats(self) -> dict[str, object]:
        if self.store is None:
            return {}
        return {f"store_{k}": round(v, 1) if isinstance(v, float) else v
                for k, v in asdict(self.store.stats).items()}

    def close(self) -> None:
        for job in list(self.scheduler.active.values()):
            self.scheduler.release(job)
            self.executor.close_sequence(job.seq_id)
        if self._reader is not None:
            self._reader.close()
        if self._writer is not None:
            # the KV of the jobs that just ended goes to the store (their Persist ops are still
            # queued), then the writer finishes, bounded: the next worker to load finds them
            try:
                self.executor.apply(self.kv.take_ops())
            except Exception:  # a fault's leftovers: the store misses these, nothing more
                log.exception("KV store: the last conversations could not be stored")
            if not self._writer.close(STORE_FLUSH_SECONDS):
                log.warning("KV store: entries still queued after %.0fs were dropped", STORE_FLUSH_SECONDS)
        self.executor.close()
        if self._embedding is not None:  # before the weights it may share
            self._embedding.close()
        if self._scoring is not None:
            self._scoring.close()
        self.model.close()

    # -- one step -------------------------------------------------------------------------------

    def _start_waiting(self) -> None:
        if self.scheduler.can_start():
            plan = self.scheduler.admission_round(self.executor.oldest_held())
            for job, why in self.executor.prepare(plan):  # that job fails, not the engine
                self.scheduler.release(job, keep_kv=False)
                self._finished.append(Failed(job.job_id, why))

    def _decode_step(self, events: list[Event]) -> None:
        self.scheduler.step_started(time.perf_counter())
        plan = self.scheduler.plan_step()
        self.executor.prepare(plan)
        for call in plan.calls:
            rc = self.executor.run(call)
            if rc != 0:
                self._settle(self.scheduler.call_failed(call, rc), events)
            else:
                sampled = self.executor.sample(call)
                self._settle(self.scheduler.update(call, sampled, self.executor.last_decode_seconds), events)
        for job in self.scheduler.end_step():
            self.executor.close_sequence(job.seq_id)
            assert job.done is not None
            events.append(job.done)

    def _settle(self, update: CallUpdate, events: list[Event]) -> None:
        events.extend(update.events)
        for job in update.finished:
            assert job.done is not None
            sampler = self.executor.sampler(job)
            self.grammar_rejections += sampler.rejections
            if sampler.top_logprobs is not None:  # the end-of-generation token is not output
                job.done.extra["logprobs"] = sampler.logprobs[: job.generated]
        for seq_id in update.released:
            self.executor.close_sequence(seq_id)
        self.executor.apply(update.kv_ops)
