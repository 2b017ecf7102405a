"""Runs the scheduler's plans on llama.cpp: applies the KV operations a plan or an update carries
(llama_memory_seq_rm / seq_cp), opens the new jobs' sampler chains, fills the batch, calls
llama_decode and samples with one chain per sequence.

It decides nothing about who runs or what a token means; what it owns is the mechanics: where
each row goes in the batch, where a sequence's logits are, the throw-away rows that top up an
equal-width ubatch, how a copy is done in each KV layout, and which rows to sample (a draft row
only while the draft held so far: `Sampled`). Per step it writes the batch in place (no per-row
objects) and samples with one `SequenceSampler` per sequence (sampling.py: chains, grammars,
logprobs).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import llama_cpp as ll

from backends.base import JobRejected
from backends.llamacpp.candidates import Candidates, TopCandidates
from backends.llamacpp.kv import Drop, KvOp, Persist, Remove, Restore, Save, Stash, Unstash, holds_window
from backends.llamacpp.kv_store import Entry
from backends.llamacpp.model import LoadedModel
from backends.llamacpp.sampling import SequenceSampler
from backends.llamacpp.scheduler import DecodeCall, StepPlan
from backends.llamacpp.state import ActiveJob, Sampled

# the state of a sequence's sliding-window layers only (llama-server's context checkpoints)
_WINDOWED = ll.LLAMA_STATE_SEQ_FLAGS_SWA_ONLY


class Executor:
    def __init__(self, model: LoadedModel, *, n_batch: int, n_streams: int, per_slot: bool) -> None:
        self.model = model
        self.per_slot = per_slot
        self._n_streams = n_streams
        self._ctx = model.ctx
        self._memory = model.memory
        self._batch = ll.llama_batch_init(n_batch, 0, 1)
        # the batch's arrays never move: keep their pointers, and every row holds one sequence id
        self._token = self._batch.token
        self._pos = self._batch.pos
        self._logits = self._batch.logits
        self._seq_id = [self._batch.seq_id[i] for i in range(n_batch)]
        for i in range(n_batch):
            self._batch.n_seq_id[i] = 1
        self._samplers: list[SequenceSampler | None] = [None] * n_streams
        self._candidates: Candidates | None = None  # made for the first job with a grammar
        self._top = TopCandidates()  # sampling is one sequence at a time: one array serves all
        self.thought: tuple[str, str] | None = None  # the template's thought markers (the engine's)
        self._logits_row = [-1] * n_streams  # per sequence id: its logits' row in the last batch
        # checkpoints of sequences' windowed layers (kv.py: Save, Restore), by (seq id, position)
        self._checkpoints: dict[tuple[int, int], ctypes.Array[ctypes.c_uint8]] = {}
        # host-RAM entries (kv.py: Stash, Unstash, Drop): a finished sequence's whole state, by
        # the entry's (negative) id; each one's bytes, checkpoints included, go in stash_sizes
        # (the bookkeeper's budget reads them: the engine shares one dict between the two)
        self._ram: dict[int, ctypes.Array[ctypes.c_uint8]] = {}
        self.stash_sizes: dict[int, int] = {}
        # the KV store's writer (Persist ops hand it copies; None: no store)
        self.persist: Callable[[Entry], object] | None = None
        self.decode_calls = 0
        self.decode_seconds = 0.0
        self.last_decode_seconds = 0.0
        # cores lent to the worker's text thread (written there, read here before each decode):
        # ggml's threads wait for each other at every operation, so a decode thread that shares
        # its core with a busy tokenizer stalls them all; one thread fewer decodes a little slower
        self._lent = 0
        self._threads = model.threads

    # -- KV and sampler chains --------------------------------------------------------------------

    def prepare(self, plan: StepPlan) -> list[tuple[ActiveJob, str]]:
        """What a plan does before its calls: its KV operations, then the new jobs' chains.
        Returns the jobs whose chain refused them (their own grammar), with why."""
        self.apply(plan.kv_ops)
        refused = []
        for job in plan.started:
            try:
                self.open(job)
            except JobRejected as e:
                refused.append((job, str(e)))
        return refused

    def oldest_held(self) -> list[int]:
        """Per sequence id, the oldest position its sliding-window layers still hold (-1: none);
        empty when no layer keeps only its window (nothing to read)."""
        if not self.model.n_swa:
            return []
        return [int(ll.llama_memory_seq_pos_min(self._memory, s)) for s in range(self._n_streams)]

    def apply(self, ops: list[KvOp]) -> None:
        for op in ops:
            if isinstance(op, Remove):
                ll.llama_memory_seq_rm(self._memory, op.seq_id, op.start, -1)
                self._forget_after(op.seq_id, op.start)
            elif isinstance(op, Save):
                self._save(op)
            elif isinstance(op, Restore):
                self._restore(op)
            elif isinstance(op, Stash):
                self._stash(op)
            elif isinstance(op, Unstash):
                self._set_state(op.seq_id, self._ram[op.key], 0)  # only what was stashed
            elif isinstance(op, Persist):
                self._persist(op)
            elif isinstance(op, Drop):
                self._ram.pop(op.key, None)
                self._forget_after(op.key, -1)
                self.stash_sizes.pop(op.key, None)
            elif self.per_slot:  # across streams llama.cpp copies a whole stream: copy, then cut
                ll.llama_memory_seq_cp(self._memory, op.src, op.dst, -1, -1)
                ll.llama_memory_seq_rm(self._memory, op.dst, op.n_tokens, -1)
            else:  # one pool: the cells just gain a sequence id
                ll.llama_memory_seq_cp(self._memory, op.src, op.dst, 0, op.n_tokens)

    def _save(self, op: Save) -> None:
        if op.forget is not None:
            self._checkpoints.pop((op.seq_id, op.forget), None)
        self._checkpoints[(op.seq_id, op.pos)] = self._state(op.seq_id, _WINDOWED)

    def _stash(self, op: Stash) -> None:
        self._ram[op.key] = data = self._state(op.seq_id, 0)
        size = len(data)
        for seq_id, pos in [k for k in self._checkpoints if k[0] == op.seq_id]:  # they go along
            self._checkpoints[(op.key, pos)] = moved = self._checkpoints.pop((seq_id, pos))
            size += len(moved)
        self.stash_sizes[op.key] = size

    def _persist(self, op: Persist) -> None:
        if self.persist is None:
            return
        size = ll.llama_state_seq_get_size_ext(self._ctx, op.seq_id, 0)
        state = bytearray(size)  # the writer thread owns it from here: no second copy
        if ll.llama_state_seq_get_data_ext(self._ctx, (ctypes.c_uint8 * size).from_buffer(state), size,
                                           op.seq_id, 0) != size:
            raise RuntimeError(f"llama.cpp could not save the state of sequence {op.seq_id}")
        oldest = max(0, int(ll.llama_memory_seq_pos_min(self._memory, op.seq_id))) if self.model.n_swa else 0
        # only the checkpoints the window has moved past: where the state still holds a
        # checkpoint's window it serves that prefix itself (most chats shorter than the window).
        # A checkpoint's array is replaced, never changed: the writer may read it as it is.
        checkpoints = sorted((pos, memoryview(data)) for (seq_id, pos), data in self._checkpoints.items()
                             if seq_id == op.seq_id and not holds_window(oldest, pos, self.model.n_swa))
        e = op.entry
        self.persist(Entry(e.tenant, e.tokens, e.n_prompt, oldest, state, checkpoints))

    def hold(self, key: int, entry: Entry) -> int:
        """Keep a state read from the KV store as RAM entry `key` (kv.adopt); its bytes."""
        self._ram[key] = _array(entry.state)
        size = len(entry.state)
        for pos, data in entry.checkpoints:
            self._checkpoints[(key, pos)] = _array(data)
            size += len(data)
        self.stash_sizes[key] = size
        return size

    def _state(self, seq_id: int, flags: int) -> ctypes.Array[ctypes.c_uint8]:
        size = ll.llama_state_seq_get_size_ext(self._ctx, seq_id, flags)
        data = (ctypes.c_uint8 * size)()
        if ll.llama_state_seq_get_data_ext(self._ctx, data, size, seq_id, flags) != size:
            raise RuntimeError(f"llama.cpp could not save the state of sequence {seq_id}")
        return data

    def _restore(self, op: Restore) -> None:
        # the bookkeeper only restores what was saved
        self._set_state(op.seq_id, self._checkpoints[(op.src, op.pos)], _WINDOWED)

    def _set_state(self, seq_id: int, data: ctypes.Array[ctypes.c_uint8], flags: int) -> None:
        if not ll.llama_state_seq_set_data_ext(self._ctx, data, len(data), seq_id, flags):
            raise RuntimeError(f"llama.cpp could not restore a saved state into sequence {seq_id}")

    def _forget_after(self, seq_id: int, start: int) -> None:
        for key in [k for k in self._checkpoints if k[0] == seq_id and (start < 0 or k[1] > start)]:
            del self._checkpoints[key]

    def checkpoint_bytes(self) -> int:
        """Checkpoints of sequences (a RAM entry's count in ram_bytes). Stats may be read while
        a step runs on another thread (backend.overlap): the dict is copied (in C) first."""
        return sum(len(d) for (seq_id, _), d in list(self._checkpoints.items()) if seq_id >= 0)

    def open(self, job: ActiveJob) -> None:
        if job.sampling.constrained() and self._candidates is None:
            self._candidates = Candidates(self.model.n_vocab)
        self._samplers[job.seq_id] = SequenceSampler(self.model, job.sampling, job.tokens, self._candidates,
                                                     self._top, resumed=job.resumed, thought=self.thought)

    def close_sequence(self, seq_id: int) -> None:
        sampler = self._samplers[seq_id]
        if sampler is not None:
            sampler.close()
            self._samplers[seq_id] = None

    def sampler(self, job: ActiveJob) -> SequenceSampler:
        sampler = self._samplers[job.seq_id]
        assert sampler is not None
        return sampler

    def sample(self, call: DecodeCall) -> Sampled:
        """What the call's rows give: each decoder's next token and its draft rows, each
        finished prompt's first token."""
        out = Sampled()
        drafts = call.drafts
        for job in call.decoders:
            self._sample_rows(job.seq_id, drafts.get(job.seq_id), out)
        for job, count in call.prompts:
            if job.n_past + count == len(job.tokens):
                self._sample_rows(job.seq_id, None, out)
        return out

    def _sample_rows(self, seq_id: int, draft: Sequence[int] | None, out: Sampled) -> None:
        """The sequence's next token; with a draft, the row after each draft token too while the
        token sampled before is that draft token (draft row i fed draft token i, speculation.py).
        The rows after a mismatch or an end of generation say nothing: they are not sampled; nor
        are those after the token at which a lazy grammar fired (they were sampled without it):
        every row sampled is accepted into the grammar, and a grammar cannot be rolled back."""
        sampler = self._samplers[seq_id]
        assert sampler is not None
        row, ctx, model = self._logits_row[seq_id], self._ctx, self.model
        waits = sampler.grammar_waits
        try:
            tok = sampler.sample(ctx, row)
            piece = None if model.is_eog(tok) else model.piece(tok)
            rows = [(tok, piece)]
            if draft:
                for i, proposed in enumerate(draft, 1):
                    if tok != proposed or piece is None or (waits and not sampler.grammar_waits):
                        break
                    tok = sampler.sample(ctx, row + i)
                    piece = None if model.is_eog(tok) else model.piece(tok)
                    rows.append((tok, piece))
        except JobRejected as e:  # its grammar has no way on (a job drafts only while it waits)
            out.rejected[seq_id] = str(e)
            return
        out.rows[seq_id] = rows
        if waits and not sampler.grammar_waits:
            out.triggered.add(seq_id)
        if sampler.grammar_complete:
            out.grammar_complete.add(seq_id)

    # -- one llama_decode -------------------------------------------------------------------------

    def run(self, call: DecodeCall) -> int:
        """Decode one call of a step plan; llama_decode's return code (0: done)."""
        if call.span is not None:
            return self._run_equal(call)
        n = 0
        for job in call.decoders:
            n = self._put_decoder(n, job, call.drafts.get(job.seq_id, ()))
        for job, count in call.prompts:
            n = self._put_prompt(n, job, count)
        if not call.pad:
            return self._decode(n)
        job = call.decoders[0]  # a throw-away row after its own: causal attention ignores it
        self._put(n, 0, job.n_past + 1, job.seq_id, False)
        rc = self._decode(n + 1)
        ll.llama_memory_seq_rm(self._memory, job.seq_id, job.n_past + 1, -1)
        return rc

    def _run_equal(self, call: DecodeCall) -> int:
        assert call.span is not None
        lo, hi = call.span
        width = call.width
        decoders = {job.seq_id: job for job in call.decoders}
        prompts = {job.seq_id: (job, count) for job, count in call.prompts}
        pads: list[tuple[int, int]] = []
        n = 0
        for seq_id in range(lo, hi + 1):
            start = n
            decoder = decoders.get(seq_id)
            if decoder is not None:
                draft = call.drafts.get(seq_id, ())
                n = self._put_decoder(n, decoder, draft)
                pos = decoder.n_past + 1 + len(draft)
            elif seq_id in prompts:
                job, count = prompts[seq_id]
                n = self._put_prompt(n, job, count)
                pos = job.n_past + count
            else:
                pos = ll.llama_memory_seq_pos_max(self._memory, seq_id) + 1
            if n - start < width:  # throw-away rows after its own: causal attention ignores them
                pads.append((seq_id, pos))
                for i in range(width - (n - start)):
                    self._put(n, 0, pos + i, seq_id, False)
                    n += 1
        rc = self._decode(n)
        for seq_id, pos in pads:
            ll.llama_memory_seq_rm(self._memory, seq_id, pos, -1)
        return rc

    def _put(self, i: int, token: int, pos: int, seq_id: int, logits: bool) -> None:
        self._token[i] = token
        self._pos[i] = pos
        self._seq_id[i][0] = seq_id
        self._logits[i] = logits

    def _put_decoder(self, n: int, job: ActiveJob, draft: Sequence[int] = ()) -> int:
        """Its next token, then its draft tokens, each row with logits (the verification)."""
        assert job.next_token is not None
        self._put(n, job.next_token, job.n_past, job.seq_id, True)
        self._logits_row[job.seq_id] = n
        for i, token in enumerate(draft, 1):
            self._put(n + i, token, job.n_past + i, job.seq_id, True)
        return n + 1 + len(draft)

    def _put_prompt(self, n: int, job: ActiveJob, count: int) -> int:
        tokens, start, seq_id = job.tokens, job.n_past, job.seq_id
        for i in range(count):
            self._put(n + i, tokens[start + i], start + i, seq_id, False)
        if start + count == len(tokens):  # the prompt's last token yields the first logits
            self._logits[n + count - 1] = True
            self._logits_row[seq_id] = n + count - 1
        return n + count

    @contextmanager
    def lending_a_core(self) -> Iterator[None]:
        """While the caller (one other thread) computes, decodes use one thread fewer."""
        self._lent += 1
        try:
            yield
        finally:
            self._lent -= 1

    def _decode(self, n_rows: int) -> int:
        threads = max(1, self.model.threads - self._lent)
        if threads != self._threads:
            ll.llama_set_n_threads(self._ctx, threads, threads)
            self._threads = threads
        self._batch.n_tokens = n_rows
        t0 = time.perf_counter()
        rc = ll.llama_decode(self._ctx, self._batch)
        self.last_decode_seconds = time.perf_counter() - t0
        self.decode_seconds += self.last_decode_seconds
        self.decode_calls += 1
        return int(rc)

    def clear(self) -> None:
        """Forget every sequence's KV and what is kept beside it (a fresh start after a fault)."""
        for seq_id in range(self._n_streams):
            self.close_sequence(seq_id)
        ll.llama_memory_clear(self._memory, True)
        self._checkpoints.clear()
        self._ram.clear()
        self._logits_row = [-1] * self._n_streams

    def close(self) -> None:
        for seq_id in range(len(self._samplers)):
            self.close_sequence(seq_id)
        ll.llama_batch_free(self._batch)


def _array(data: bytes | bytearray | memoryview) -> ctypes.Array[ctypes.c_uint8]:
    """llama.cpp's view of a state's bytes (over a bytearray's memory, or a writable view of
    one: no copy)."""
    if isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly):
        return (ctypes.c_uint8 * len(data)).from_buffer(data)
    return (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
