"""The engine's scheduling policy, without llama.cpp: who gets a slot, what each step decodes,
and what the sampled tokens do to each job (`update`, with the rules of updates.py).

Each step is a `StepPlan`: one or more `DecodeCall`s (one `llama_decode` each) holding the next
token of every decoding job plus, within the token budget (n_batch), chunks of newcomers'
prompts. So streams keep producing tokens while a long prompt prefills (chunked prefill), and
new jobs join between steps.

- Unified pool (kv_unified=true): one call per step, decoders first, then prompt
  chunks in admission order until n_batch rows. Decoders draft (speculation) only in a call with
  no prompt chunk, and a call of a single row gets a throw-away second row (a lone row over
  SPLIT_KV_CELLS cells would take ggml's split-KV attention, see invariance.py; a drafted lone
  decoder never does).
- Per-slot streams (kv_unified=false, the default): the same work split so that each row meets the same ggml
  kernels as if its job ran alone (what batch_invariant relies on; docs/ARCHITECTURE.md,
  "Determinism"): one call for the decoders, one for the short
  prompts that fit (under FA_TILE_ROWS rows left to prefill: row-by-row attention however they
  are split; with batch_invariant, under FA_TILE_ROWS tokens in all), then
  each other prompt's chunk in a call of its own, cut at multiples of n_batch whatever the load.
  Calls that share a ubatch give every sequence id from the lowest to the highest member the same
  number of rows (`span`, `width`): llama.cpp cuts a per-stream batch into ubatches of
  consecutive ids with equal rows, and a row's kernels depend on its ubatch.

A plan also carries what the executor does before its calls: the KV operations the bookkeeper
queued since the executor last got some, and the jobs that just got a slot (their sampler
chains). Between steps an admission round is a plan with no calls.

Admission: a job waits for a free slot and, in the unified pool, for room for its reservation
(prompt + max_tokens, capped by n_ctx_per_seq); it keeps its place in line. A job whose prompt
starts with a long prefix another job is prefilling right now waits for that prefix (keeping its
slot) and then reuses it, so a burst sharing a new system prompt prefills it once. Preemption (taking a
slot back from a running job) is not done yet: it would be a decision made here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from backends.base import Failed, JobRejected
from backends.contract.schema import Sampling
from backends.llamacpp.invariance import FA_TILE_ROWS, SPLIT_KV_CELLS, reusable_prefix
from backends.llamacpp.kv import KvBookkeeper, KvOp, common_prefix
from backends.llamacpp.pacing import MIN_ROWS, PrefillPace
from backends.llamacpp.runs import cheapest_runs
from backends.llamacpp.speculation import NgramIndex, StepCosts, draft_room, may_draft
from backends.llamacpp.state import ActiveJob, Sampled, WaitingJob
from backends.llamacpp.updates import CallUpdate, advance

# What one more llama_decode costs, in prompt rows: a lone prompt's call took ~10.6 ms + 1.0 ms
# a row on the embedded model (2 cores, AMD EPYC; 3 to 88 rows)
CALL_ROWS = 11
# a newcomer waits for a prefix another job is prefilling when it would reuse this many more
# tokens by it (below, prefilling them beside it costs less than the wait's extra step)
MIN_HELD_PREFIX = 64


@dataclass(slots=True)
class DecodeCall:
    """One llama_decode: decoders feed their next token (one row each), prompts a chunk of
    `count` tokens from their n_past."""

    decoders: list[ActiveJob] = field(default_factory=list)
    prompts: list[tuple[ActiveJob, int]] = field(default_factory=list)
    # batch-invariant ubatch: every sequence id lo..hi gets `width` rows, topped up with
    # throw-away rows after its own ones (None: rows as they come)
    span: tuple[int, int] | None = None
    width: int = 0
    # speculation: draft tokens a decoder feeds after its next token (seq_id -> tokens), verified
    # by their logits in this same call
    drafts: dict[int, list[int]] = field(default_factory=dict)
    # unified pool: a throw-away row after the lone decoder's own (its KV removed after the call)
    pad: bool = False

    def n_rows(self) -> int:
        if self.span is not None:
            return (self.span[1] - self.span[0] + 1) * self.width
        return self.decoder_rows() + sum(count for _, count in self.prompts) + self.pad

    def decoder_rows(self) -> int:
        """Rows with a decoder's logits: its next token and its draft tokens."""
        return len(self.decoders) + sum(len(d) for d in self.drafts.values())

    def members(self) -> list[ActiveJob]:
        return [*self.decoders, *(job for job, _ in self.prompts)]


@dataclass(slots=True)
class StepPlan:
    """What the executor does next: apply kv_ops, open the started jobs' samplers, run the calls."""

    calls: list[DecodeCall]
    # the bookkeeper's operations queued since the executor last got some (releases, evictions,
    # prefix copies), in order
    kv_ops: list[KvOp] = field(default_factory=list)
    started: list[ActiveJob] = field(default_factory=list)  # just got a slot


class Scheduler:
    def __init__(self, kv: KvBookkeeper, *, n_batch: int, n_ctx_per_seq: int, draft_max: int = 0,
                 max_stall_ms: float = 0.0, max_prefill_slowdown: float = 1.0) -> None:
        check_n_batch(n_batch, kv.n_streams)
        self.kv = kv
        self.slots = kv.slots
        self.per_slot = kv.per_slot
        self.n_batch = n_batch
        self.n_ctx_per_seq = n_ctx_per_seq
        self.draft_max = draft_max
        self.costs = StepCosts()  # every decoders-only call's time goes in (update)
        # every lone prompt chunk's time goes in (update): what a step beside decoders may take
        self.pace = PrefillPace(max_stall_ms / 1000, max_prefill_slowdown)
        self.waiting: list[WaitingJob] = []
        self.active: dict[str, ActiveJob] = {}  # admission order = prefill order
        self.deferred_admissions = 0
        self.steps = 0
        self.prompt_tokens_prefilled = 0
        self.tokens_generated = 0
        self.draft_tokens = 0  # proposed by prompt lookup (speculation.py) ...
        self.draft_accepted = 0  # ... and kept
        # newcomers-only steps since the decoders last ran: how many, and their decode time; and
        # the decoders' last call (what a further newcomers-only step is weighed against)
        self._skips = 0
        self._skipped_seconds = 0.0
        self._decoders_seconds = 0.0

    def carry_counters(self, old: Scheduler) -> None:
        """A fresh scheduler (after an engine fault) goes on counting where `old` was."""
        for name in ("deferred_admissions", "steps", "prompt_tokens_prefilled", "tokens_generated",
                     "draft_tokens", "draft_accepted"):
            setattr(self, name, getattr(old, name))

    # -- admission --------------------------------------------------------------------------------

    def free_slots(self) -> int:
        return self.slots - len(self.active) - len(self.waiting)

    def enqueue(self, job_id: str, tokens: list[int], sampling: Sampling, resumed: int = 0,
                tenant: str = "") -> WaitingJob:
        if self.free_slots() <= 0:
            raise RuntimeError("no free slot")  # the worker checks free_slots() first
        if len(tokens) + 1 > self.n_ctx_per_seq:
            raise JobRejected(
                f"prompt is {len(tokens)} tokens; the context holds {self.n_ctx_per_seq} per job "
                f"(backend.n_ctx_per_seq)"
            )
        waiting = WaitingJob(job_id, tokens, sampling, resumed, tenant)
        self.waiting.append(waiting)
        return waiting

    def can_start(self) -> bool:
        return bool(self.waiting) and self.kv.has_free_slot()

    def admission_round(self, oldest_held: Sequence[int] = ()) -> StepPlan:
        """Start waiting jobs (see start_waiting) as a plan with no calls: the KV operations the
        bookkeeper queued (prefix copies, evictions, earlier releases) and the jobs started."""
        started = self.start_waiting(oldest_held)
        return StepPlan([], self.kv.take_ops(), started)

    def start_waiting(self, oldest_held: Sequence[int] = ()) -> list[ActiveJob]:
        """Give free slots to waiting jobs, first come first served, but for a job waiting for a
        prefix another job is prefilling (`_prefix_coming`) or for the KV store's read of its
        entry (`reading`): it keeps its slot (and in the
        unified pool its cells), and jobs behind it that need neither may start. Each newcomer
        reuses what KV it can (the bookkeeper queues the copies). oldest_held: per sequence id,
        the oldest position its windowed layers still hold, read now (the bookkeeper's reuse
        rule needs it when layers keep only their window). Returns the jobs started."""
        self.kv.oldest_held = oldest_held
        started: list[ActiveJob] = []
        held, held_cells = 0, 0  # jobs ahead waiting for a prefix being prefilled
        while len(self.waiting) > held and self.kv.free_ids() > held:
            waiting = self.waiting[held]
            need = min(len(waiting.tokens) + waiting.sampling.max_tokens, self.n_ctx_per_seq)
            if waiting.reading or self._prefix_coming(waiting.tokens, waiting.tenant):
                held, held_cells = held + 1, held_cells + need
                continue
            if held_cells and not self.kv.fits(need + held_cells):
                break  # the pool's cells go to the held jobs first
            seq_id = self.kv.allocate(need, waiting.tokens, waiting.tenant)
            if seq_id is None:
                self.deferred_admissions += 1
                break  # running jobs will free KV cells; the job keeps its place in line
            job = ActiveJob.start(waiting, seq_id, need)
            if self.draft_max and may_draft(waiting.sampling):  # see speculation.py
                job.ngrams = NgramIndex(job.tokens)
            self.kv.reuse_prefix(job, self.active.values())
            self.waiting.pop(held)  # not before: a fault above must find the job in line
            self.active[job.job_id] = job
            started.append(job)
        return started

    def _prefix_coming(self, tokens: Sequence[int], tenant: str = "") -> bool:
        """Is a job still prefilling a long prefix of `tokens` that no KV holds yet? Then the
        waiting job starts once it is there and reuses it: the same tokens prefilled beside it
        would cost as much of the CPU as the wait does (a burst with a new system prompt)."""
        coming = 0
        for job in self.active.values():
            if job.next_token is None and job.tenant == tenant:
                n = min(common_prefix(job.tokens, tokens), len(tokens) - 1)
                if self.kv.invariant:  # what the reuse rule will allow of it
                    n = reusable_prefix(n, len(job.tokens), len(tokens), self.n_batch)
                if n > job.n_past:
                    coming = max(coming, n)
        if coming < MIN_HELD_PREFIX:
            return False
        enough = coming - MIN_HELD_PREFIX + 1  # a source with this much: no wait
        return self.kv.longest_reusable(tokens, self.active.values(), enough, tenant) < enough

    def cancel_waiting(self, job_id: str) -> bool:
        for i, waiting in enumerate(self.waiting):
            if waiting.job_id == job_id:
                del self.waiting[i]
                return True
        return False

    def release(self, job: ActiveJob, keep_kv: bool = True) -> None:
        self.active.pop(job.job_id, None)
        self.kv.release(job, keep_kv)

    # -- one step ---------------------------------------------------------------------------------

    def plan_step(self) -> StepPlan:
        self.steps += 1
        decoding = [j for j in self.active.values() if j.next_token is not None]
        prefilling = [j for j in self.active.values() if j.next_token is None]
        if self.per_slot:
            return StepPlan(self._invariant_calls(decoding, prefilling), self.kv.take_ops())
        return StepPlan([self._pooled_call(decoding, prefilling)], self.kv.take_ops())

    def step_started(self, now: float) -> None:
        self.pace.step_started(now)

    def update(self, call: DecodeCall, sampled: Sampled, seconds: float = 0.0) -> CallUpdate:
        """Move the call's jobs on by what it sampled (`seconds`: its decode time): prompt
        progress, draft acceptance and the finish rules of updates.py."""
        out = CallUpdate()
        events = out.events
        rows, whole, n_ctx = sampled.rows, sampled.grammar_complete, self.n_ctx_per_seq
        self.pace.decoded(seconds, streams=bool(call.decoders) and not call.prompts and not call.drafts)
        if call.decoders and not call.prompts:  # what the draft budget weighs (speculation.py)
            self.costs.record(call.n_rows(), call.decoder_rows(), seconds)
        if call.decoders:
            self._decoders_seconds, self._skipped_seconds = seconds, 0.0
        elif self._skips:
            self._skipped_seconds += seconds
        for job in call.decoders:
            seq_id = job.seq_id
            got = rows.get(seq_id)
            if got is None:
                self._reject(job, sampled.rejected[seq_id], out)
                continue
            before = job.generated
            draft = call.drafts.get(seq_id, ())
            fired = seq_id in sampled.triggered  # its rows end where its lazy grammar fired
            job.n_past += 1
            kept = advance(job, got, draft[:len(got) - 1] if fired else draft, seq_id in whole, n_ctx, events)
            self.tokens_generated += job.generated - before
            if draft:
                self.draft_tokens += len(draft)
                self.draft_accepted += kept
                if job.ngrams is not None:
                    job.ngrams.record(len(draft), kept)
                if kept < len(draft):
                    self.kv.drop_tail(job)
            if fired:
                job.ngrams = None  # its grammar applies now: one token at a time
            if job.done is not None:
                out.finished.append(job)
        if call.prompts and not call.decoders and call.span is None and len(call.prompts) == 1:
            self.pace.record(call.prompts[0][1], call.prompts[0][0].n_past, seconds)
        for job, count in call.prompts:
            job.n_past += count
            job.chunks += 1
            self.prompt_tokens_prefilled += count
            if job.n_past == len(job.tokens):  # its last row gave the first token
                self.kv.prompt_done(job)
                got = rows.get(job.seq_id)
                if got is None:
                    self._reject(job, sampled.rejected[job.seq_id], out)
                    continue
                advance(job, got, (), job.seq_id in whole, n_ctx, events)
                self.tokens_generated += job.generated - job.resumed  # its first: 0 or 1
                if job.done is not None:
                    out.finished.append(job)
        out.kv_ops = self.kv.take_ops()
        return out

    def call_failed(self, call: DecodeCall, rc: int) -> CallUpdate:
        """The call's llama_decode returned rc != 0: the jobs it fails (see failed) are freed."""
        why = "KV cache full" if rc == 1 else f"llama_decode failed (rc={rc})"
        out = CallUpdate()
        for job in self.failed(call, rc):
            self._drop(job, out)
            out.events.append(Failed(job.job_id, f"{why}; job not completed", retryable=rc == 1))
        out.kv_ops = self.kv.take_ops()
        return out

    def end_step(self) -> list[ActiveJob]:
        """Free the slots of the jobs that ended this step (admission order); their KV operations
        go with the next plan."""
        ended = [j for j in self.active.values() if j.done is not None]
        for job in ended:
            self.release(job)
        return ended

    def _reject(self, job: ActiveJob, why: str, out: CallUpdate) -> None:
        self._drop(job, out)
        out.events.append(Failed(job.job_id, why))

    def _drop(self, job: ActiveJob, out: CallUpdate) -> None:
        job.done = None
        self.release(job, keep_kv=False)
        out.released.append(job.seq_id)

    def failed(self, call: DecodeCall, rc: int) -> list[ActiveJob]:
        """The jobs to fail when `call` returned rc != 0. rc 1: no KV slot for the batch.
        Admission reserves cells, so the cache is fragmented or over-committed: fail the newest
        prompt, keep the decoders (in an equal-width ubatch all rows stand or fall together)."""
        if rc == 1 and call.prompts and call.span is None:
            return [call.prompts[-1][0]]
        return call.members()

    def _pooled_call(self, decoding: list[ActiveJob], prefilling: list[ActiveJob]) -> DecodeCall:
        budget = self.n_batch - len(decoding)
        prompts: list[tuple[ActiveJob, int]] = []
        for job in prefilling:
            if budget <= 0:
                break
            count = min(budget, len(job.tokens) - job.n_past)
            prompts.append((job, count))
            budget -= count
        # drafts only beside no prompt chunk: the chunk's rows would weigh in their cost
        n = len(decoding)
        # a lone row takes the split-KV attention past SPLIT_KV_CELLS, a drafted step never: an
        # undrafted lone decoder gets a second row (when the pool has a cell to spare), so its
        # text is the same with and without speculation
        lone = n == 1 and not prompts and self.kv.fits(1)
        base = (2, 1) if lone else (n, n)  # (rows, rows with logits)
        room = 0 if prompts else draft_room(n, self.draft_max)
        drafts = self._drafts(decoding, room, base, lambda j, m: (n + m * j, n + m * j))
        return DecodeCall(decoding, prompts, drafts=drafts, pad=lone and not drafts)

    def _invariant_calls(self, decoding: list[ActiveJob], prefilling: list[ActiveJob]) -> list[DecodeCall]:
        short, alone = self._pick_short(prefilling)
        # With a stall target, a newcomer whose own step would hold the streams past it is paced
        # beside them as a long prompt is (a 500-token first turn is seconds of prefill on a CPU)
        paced = bool(decoding) and self.pace.target > 0 and not self.kv.invariant
        budget = self.pace.alone_budget(self._skipped_seconds) if paced else 0.0
        if paced:
            fitting = [self.pace.fits(len(job.tokens) - job.n_past, job.n_past, budget) for job in short]
            alone += [job for job, fits in zip(short, fitting, strict=True) if not fits]
            short = [job for job, fits in zip(short, fitting, strict=True) if fits]
        # Newcomers whose whole prompt this step prefills (short ones, and longer ones in one
        # chunk: a returning conversation's new tokens after its reused history) go first, in a
        # step of their own, so their first token goes out one decoders' call sooner (time to
        # first token); the decoders' tokens come out at the end of a step either way. Newcomers
        # that arrive during that step may take one more while the newcomers' steps so far took
        # less than one decoders' call: the decoders wait at most about one more step, never
        # without bound. A prompt of several chunks prefills beside the decoders, to its end.
        chunks = [(job, self._chunk(job)) for job in alone]
        ending = [(job, n) for job, n in chunks if not job.chunks and job.n_past + n == len(job.tokens)
                  and (not paced or self.pace.fits(n, job.n_past, budget))]
        # With a stall target, a long prompt prefilling beside the streams already takes what
        # their wait allows: no newcomers' step on top of it (invariance: chunks end at n_batch)
        midway = paced and any(job.chunks for job in prefilling)
        newcomers_only = bool((short or ending) and decoding and not midway) and (
            self._skips == 0 or self._skipped_seconds < self._decoders_seconds)
        self._skips = self._skips + 1 if newcomers_only else 0
        if newcomers_only:
            decoding, chunks = [], ending
        calls: list[DecodeCall] = []
        if decoding:
            # Beside a paced prompt (to its last rows) the decoders do not draft: a drafted call
            # costs ~2x, and the prompt's share of each step (max_prefill_slowdown) grows with
            # it, so the streams' gap would double for about the same tokens a second
            calls.append(self._decoders_call(decoding, draft=not (paced and (chunks or midway))))
        shorts = self._short_calls(short)
        if paced and not newcomers_only:
            spent = sum(self.pace.seconds(c.n_rows(), max(j.n_past for j in c.members())) for c in shorts)
            chunks = self._paced(chunks, spent, floor=0 if shorts else MIN_ROWS)
        budget = self.n_batch - len(decoding)
        for call in shorts:
            calls.append(call)
            budget -= call.n_rows()
        for job, count in chunks:
            if budget <= 0:
                break
            calls.append(DecodeCall(prompts=[(job, count)]))
            budget -= count
        return calls

    def _paced(self, chunks: list[tuple[ActiveJob, int]], spent: float,
               floor: int) -> list[tuple[ActiveJob, int]]:
        """The prompt chunks that fit beside the decoders (pacing.py), from the prompts' rows
        left (not cut at n_batch multiples: only invariance needs those). The streams have waited
        since their last call: that call, any newcomers' steps since, this step's short prompts."""
        wanted = [(job, min(len(job.tokens) - job.n_past, self.n_batch)) for job, _ in chunks]
        return self.pace.cut(wanted, self._skipped_seconds + spent, floor)

    def _chunk(self, job: ActiveJob) -> int:
        """A prompt's next chunk when it runs alone: chunks end at multiples of n_batch, as when
        the prompt runs with no other job (whatever the load)."""
        return min(len(job.tokens), (job.n_past // self.n_batch + 1) * self.n_batch) - job.n_past

    def _decoders_call(self, decoding: list[ActiveJob], draft: bool = True) -> DecodeCall:
        """All decoders in one equal-width ubatch: one row each, plus their drafts (speculation)
        while the call stays within DRAFT_CALL_ROWS rows (speculation.draft_room)."""
        lo = min(j.seq_id for j in decoding)
        hi = max(j.seq_id for j in decoding)
        n, ids = len(decoding), hi - lo + 1
        undrafted = self._span(decoding, 1)
        room = draft_room(ids, self.draft_max) if draft else 0
        if room:  # every id lo..hi gets the widest draft's rows: none may pass its stream's last cell
            room = min(room, min(self._cells_left(lo, hi)) - 1)
        drafts = self._drafts(decoding, room, (undrafted[1] - undrafted[0] + 1, n),
                              lambda j, m: (ids * (1 + j), n + m * j))
        if not drafts:
            return DecodeCall(decoders=decoding, span=undrafted, width=1)
        width = 1 + max(len(d) for d in drafts.values())
        return DecodeCall(decoders=decoding, span=(lo, hi), width=width, drafts=drafts)

    def _drafts(self, decoding: list[ActiveJob], room: int, base: tuple[int, int],
                shape: Callable[[int, int], tuple[int, int]]) -> dict[int, list[int]]:
        """Each decoder's proposal of at most `room` tokens (speculation.py), by sequence id.
        `base` is the call's shape (rows, rows with logits) without drafts, shape(j, m) with m
        decoders drafting j tokens each (m: those with something to propose, as when they copy
        text together): its timings on this machine weigh how far a job drafts."""
        drafts: dict[int, list[int]] = {}
        if not room or all(job.ngrams is None for job in decoding):
            return drafts
        able: list[tuple[ActiveJob, NgramIndex, int]] = []
        for job in decoding:
            # no draft past the job's end: max_tokens, or the last cell of its context
            k = min(room, job.sampling.max_tokens - job.generated - 1,
                    self.n_ctx_per_seq - job.n_past - 2)
            if job.ngrams is not None and k > 0:
                job.ngrams.follow(job.output)
                if job.ngrams.propose(k):
                    able.append((job, job.ngrams, k))
        m = len(able)
        costs = [self.costs.relative(shape(j, m), base) if j else 1.0 for j in range(room + 1)]
        others = (len(decoding) - m) / m if m else 0.0
        for job, ngrams, k in able:
            draft = ngrams.propose(ngrams.budget(costs[:k + 1], others))
            if draft:
                drafts[job.seq_id] = draft
        return drafts

    def _pick_short(self, prefilling: list[ActiveJob]) -> tuple[list[ActiveJob], list[ActiveJob]]:
        """Short prompts that fit one equal-width ubatch; the rest run alone. Short: under
        FA_TILE_ROWS rows left to prefill (a reused history's new tokens too); with batch
        invariance the whole prompt (a long prompt's rows must meet the kernels they meet alone)."""
        short: list[ActiveJob] = []
        alone: list[ActiveJob] = []
        for job in prefilling:
            if len(job.tokens) - (0 if self.kv.invariant else job.n_past) < FA_TILE_ROWS:
                ids = [j.seq_id for j in short] + [job.seq_id]
                width = max(len(j.tokens) - j.n_past for j in (*short, job))
                if (max(ids) - min(ids) + 1) * width <= self.n_batch:
                    short.append(job)
                    continue
            alone.append(job)
        return short, alone

    def _short_calls(self, short: list[ActiveJob]) -> list[DecodeCall]:
        """The short prompts as equal-width calls over runs of neighbouring ids. One span over all
        of them pads every id between (a running job's slot) to the widest prompt: newcomers in
        the odd slots of 16 would compute 15 prompts' rows for 8. So split where a run's padding
        costs more than a call of its own (CALL_ROWS): runs.cheapest_runs."""
        jobs = sorted(short, key=lambda j: j.seq_id)
        left = [len(j.tokens) - j.n_past for j in jobs]  # each one's rows to prefill
        cells = self._cells_left(jobs[0].seq_id, jobs[-1].seq_id) if jobs else []
        calls: list[DecodeCall] = []
        for start, end in cheapest_runs([j.seq_id for j in jobs], left, cells, CALL_ROWS):
            width = max(left[start:end])
            calls.append(DecodeCall(prompts=list(zip(jobs[start:end], left[start:end], strict=True)),
                                    span=self._span(jobs[start:end], width), width=width))
        return calls

    def _cells_left(self, lo: int, hi: int) -> list[int]:
        """KV cells free in each stream lo..hi (per-slot streams of n_ctx_per_seq cells): after a
        running job's KV, a free slot's kept KV or a prefix entry's."""
        used = {e.seq_id: len(e.tokens) for e in (*self.kv.prefixes.values(), *self.kv.slot_kv.values())}
        used.update((j.seq_id, j.n_past) for j in self.active.values())
        return [self.n_ctx_per_seq - used.get(i, 0) for i in range(lo, hi + 1)]

    def _span(self, members: list[ActiveJob], width: int) -> tuple[int, int]:
        """The ids an equal-width ubatch covers. With batch invariance a lone decoder past
        SPLIT_KV_CELLS // 2 cells gets a neighbour, else ggml splits its KV scan across threads
        (and rounds differently from the batched kernel). Without it the fleet promises what
        llama-server does, and a lone decoder decodes alone (the row cost ~17 % of its step)."""
        lo = min(j.seq_id for j in members)
        hi = max(j.seq_id for j in members)
        if (self.kv.invariant and lo == hi and width == 1
                and members[0].n_past + 1 > SPLIT_KV_CELLS // 2):
            if hi + 1 < self.kv.n_streams:
                hi += 1
            elif lo > 0:
                lo -= 1  # (a single stream has no neighbour, but then every job runs alone)
        return lo, hi


def check_n_batch(n_batch: int, n_streams: int) -> None:
    if n_batch < n_streams:  # one decode step holds a row for every sequence id
        raise ValueError(f"backend.n_batch ({n_batch}) must be at least slots + prefix_cache "
                         f"({n_streams})")
