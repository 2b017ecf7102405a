"""The KV bookkeeper: who holds which sequence id and what each id's KV holds, without llama.cpp.

Sequence ids 0..slots-1 are slots (one per running job), slots..slots+prefix_cache-1 hold
shared prefixes in an LRU. With per-slot streams (kv_unified=false) a free slot keeps its last
job's KV until the slot is reused, so the next turn of a chat prefills only what is new; in the
unified pool (kv_unified=true) a job reserves its cells when it starts and gives them back when
it ends (kept cells would widen the span every row's attention scans: measured 13 % slower at
16 users with ~600-token jobs, docs/bench.md).

The bookkeeper decides; it never calls llama.cpp. What it wants done to the KV cache (drop a
sequence's tail, copy a prefix) is queued as `KvOp`s; the scheduler hands them to the executor
in its plans and updates (`take_ops`), which applies them in order before the next decode. What
it needs to know of llama.cpp's state (how far back a windowed sequence still reaches) it is
given as data, `oldest_held`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Literal

from backends.llamacpp.invariance import reusable_prefix
from backends.llamacpp.state import ActiveJob

MIN_SHARED_PREFIX = 8  # tokens; below this copying a prefix's KV costs more than prefilling it
# a prompt shorter than this is not checkpointed: prefilling it again costs about what a
# checkpoint's copy does (gemma-3-270m: ~7 MiB for its 512-position window)
MIN_CHECKPOINT_PROMPT = 64
# a free slot whose kept KV holds this much of a newcomer's prompt is chosen over the lowest free
# id: the prefill it saves outweighs the padding rows a gap among busy ids costs each step
MIN_SLOT_CHOICE_PREFIX = 64

# a finished sequence shorter than this is not kept in host RAM: prefilling it again costs about
# what storing and restoring its state does
MIN_STASH_TOKENS = 64

ReuseSource = Literal["kept", "entry", "other slot", "running", "ram"]


@dataclass(frozen=True, slots=True)
class Remove:
    """Drop sequence `seq_id`'s KV from position `start` to its end (-1: all of it)."""

    seq_id: int
    start: int = -1


@dataclass(frozen=True, slots=True)
class Copy:
    """Give `dst` the KV of `src`'s first `n_tokens` positions (dst holds nothing before)."""

    src: int
    dst: int
    n_tokens: int


@dataclass(frozen=True, slots=True)
class Save:
    """Checkpoint `seq_id`'s windowed layers as they are now, holding positions before `pos`;
    `forget`: an older checkpoint of the sequence to drop (the bookkeeper keeps a few)."""

    seq_id: int
    pos: int
    forget: int | None = None


@dataclass(frozen=True, slots=True)
class Restore:
    """Put `src`'s checkpoint at `pos` into `seq_id`'s windowed layers (its full-attention layers
    already hold positions before `pos`; a Remove from `pos` follows)."""

    seq_id: int
    pos: int
    src: int


@dataclass(frozen=True, slots=True)
class Stash:
    """Keep `seq_id`'s whole state (every layer) in host RAM as entry `key` (a negative id), with
    its windowed layers' checkpoints, before the sequence is emptied for another job."""

    seq_id: int
    key: int


@dataclass(frozen=True, slots=True)
class Unstash:
    """Put host-RAM entry `key`'s state into the empty sequence `seq_id` (the entry stays)."""

    key: int
    seq_id: int


@dataclass(frozen=True, slots=True)
class Drop:
    """Free host-RAM entry `key` (LRU eviction past the byte budget)."""

    key: int


@dataclass(slots=True)
class PrefixEntry:
    seq_id: int
    tokens: list[int]  # in its KV
    n_prompt: int  # prompt length of the job that computed that KV (see invariance.py)
    tenant: str = ""  # whose job computed it (the KV store keeps tenants apart)


@dataclass(frozen=True, slots=True)
class Persist:
    """Copy `seq_id`'s whole state (with its checkpoints) to the KV store as `entry` (kv_store.py);
    the sequence is left as it is."""

    seq_id: int
    entry: PrefixEntry


KvOp = Remove | Copy | Save | Restore | Stash | Unstash | Drop | Persist


@dataclass(frozen=True, slots=True)
class Reuse:
    """A reuse decision: `n_tokens` of a newcomer's prompt come from `source`'s KV."""

    n_tokens: int
    source: ReuseSource
    from_seq_id: int


class KvBookkeeper:
    def __init__(self, *, slots: int, prefix_cache: int, n_ctx: int, n_batch: int, per_slot: bool,
                 invariant: bool = False, window: int = 0, checkpoints: int = 1,
                 ram_budget: int = 0, persist_min: int = 0) -> None:
        self.slots = slots
        self.n_streams = slots + prefix_cache
        self.n_ctx = n_ctx  # cells of the unified pool (checked by fits() only when not invariant)
        self.n_batch = n_batch
        self.per_slot = per_slot
        self.invariant = invariant  # batch_invariant: reuse only KV computed as if alone (invariance.py)
        # sliding-window layers that keep only their window (0: none, or kept whole): reused KV
        # needs the `window` positions before the reuse's end, and oldest_held[seq_id] says how
        # far back a sequence's KV still reaches (llama_memory_seq_pos_min, -1: holds nothing),
        # read for each admission round (Scheduler.start_waiting)
        self.window = window
        self.oldest_held: Sequence[int] = ()
        # Checkpoints of a sequence's windowed layers, taken where its prompt ended (as
        # llama-server's context checkpoints): the next turn of a chat shares the prompt, and
        # often not the answer (edited, trimmed or re-tokenised by the client), and by then the
        # window has moved past the point where they diverge. Positions per sequence id, oldest
        # first; the executor holds the bytes.
        self.checkpoints_per_seq = checkpoints if window else 0
        self.checkpoints: dict[int, list[int]] = {}
        self.checkpoint_reuses = 0
        self._free_seq_ids = list(range(slots))
        self._free_prefix_ids = list(range(slots, self.n_streams))
        self.prefixes: OrderedDict[int, PrefixEntry] = OrderedDict()  # LRU, oldest first
        self.slot_kv: dict[int, PrefixEntry] = {}  # a free slot's kept KV (per-slot streams)
        # Host RAM (llama-server's --cache-ram): a free slot's kept KV that a newcomer is about
        # to replace is stashed whole (with its checkpoints), so the conversation finds it again
        # when it returns after its slot went to others. Entries have negative ids, LRU; the
        # executor holds the bytes and reports each entry's size in `stash_sizes` (shared, read
        # when the budget is checked); past `ram_budget` bytes the oldest go.
        self.ram_budget = ram_budget if per_slot else 0
        self.ram: OrderedDict[int, PrefixEntry] = OrderedDict()
        self.ram_oldest: dict[int, int] = {}  # entry -> oldest position its windowed layers held
        self.stash_sizes: dict[int, int] = {}
        self._next_key = -1
        self.ram_reuses = 0
        # KV store (kv_store.py): a finished job's KV of at least `persist_min` tokens is copied
        # there (0: no store); RAM entries read back from it, until a job reuses them
        self.persist_min = persist_min if per_slot else 0
        self.from_store: set[int] = set()
        self.reserved = 0
        self.reused_tokens = 0
        self._ops: list[KvOp] = []
        self._changing: set[int] = set()  # sequence ids that queued ops will change

    def carry_counters(self, old: KvBookkeeper) -> None:
        """A fresh bookkeeper (after an engine fault) goes on counting where `old` was."""
        self.reused_tokens, self.checkpoint_reuses, self.ram_reuses = (
            old.reused_tokens, old.checkpoint_reuses, old.ram_reuses)

    def take_ops(self) -> list[KvOp]:
        """The KV operations decided since the last call, in order (for the executor)."""
        ops, self._ops = self._ops, []
        self._changing.clear()
        return ops

    def _queue(self, op: Remove | Copy | Save | Restore | Stash | Unstash) -> None:
        self._ops.append(op)
        self._changing.add(op.dst if isinstance(op, Copy) else op.seq_id)
        if isinstance(op, Remove) and op.seq_id in self.checkpoints:  # the executor does the same
            kept = [p for p in self.checkpoints[op.seq_id] if op.start >= 0 and p <= op.start]
            self.checkpoints[op.seq_id] = kept

    def prompt_done(self, job: ActiveJob) -> None:
        """The job's prompt is in its KV: checkpoint its windowed layers there (see checkpoints)."""
        pos = len(job.tokens)
        if not self.checkpoints_per_seq or pos < MIN_CHECKPOINT_PROMPT:
            return
        held = self.checkpoints.setdefault(job.seq_id, [])
        if pos in held:
            return
        forget = held.pop(0) if len(held) >= self.checkpoints_per_seq else None
        held.append(pos)
        self._ops.append(Save(job.seq_id, pos, forget))

    # -- sequence ids and reservations ------------------------------------------------------------

    def has_free_slot(self) -> bool:
        return bool(self._free_seq_ids)

    def free_ids(self) -> int:
        return len(self._free_seq_ids)

    def allocate(self, need: int, tokens: Sequence[int] = (), tenant: str = "") -> int | None:
        """A slot's sequence id with `need` KV cells reserved, evicting cached prefixes to make
        room; None when the unified pool cannot hold `need` cells yet (running jobs will free
        some: admission waits, it never evicts a running job). With per-slot streams, the free
        slot whose kept KV holds the longest prefix of `tokens` (a chat's next turn finds its
        history in place), when that is worth a gap among the busy ids."""
        while not self.fits(need) and self.evict_prefix():
            pass
        if not self._free_seq_ids or not self.fits(need):
            return None
        # lowest first: busy ids stay consecutive, so the decoders fill one ubatch (see executor)
        seq_id = min(self._free_seq_ids)
        best = MIN_SLOT_CHOICE_PREFIX - 1
        for free in self._free_seq_ids if tokens else ():
            kept = self.slot_kv.get(free)
            n = self._reusable(kept, tokens)[0] if kept is not None and kept.tenant == tenant else 0
            if n > best:
                seq_id, best = free, n
        self._free_seq_ids.remove(seq_id)
        self.reserved += need
        return seq_id

    def fits(self, need: int) -> bool:
        if self.per_slot:
            return True  # each slot owns its KV stream
        # the scheduler caps `need` at n_ctx_per_seq <= n_ctx, so an idle engine always fits a job
        return self.reserved + need + self.prefix_cells() <= self.n_ctx

    def prefix_cells(self) -> int:
        return sum(len(p.tokens) for p in self.prefixes.values())

    def evict_prefix(self) -> bool:
        if not self.prefixes:
            return False
        seq_id, _ = self.prefixes.popitem(last=False)
        self._queue(Remove(seq_id))
        self._free_prefix_ids.append(seq_id)
        return True

    def release(self, job: ActiveJob, keep_kv: bool = True) -> None:
        """Free a finished/cancelled/failed job's slot and reservation. A per-slot stream keeps
        its KV for the slot's next job (see slot_kv) unless keep_kv is false."""
        if self.per_slot and keep_kv:
            kept = PrefixEntry(job.seq_id, job.kv_tokens(), len(job.tokens), job.tenant)
            self.slot_kv[job.seq_id] = kept
            if self.persist_min and len(kept.tokens) >= self.persist_min and job.n_past > job.reused:
                self._ops.append(Persist(job.seq_id, kept))  # changes nothing: not `_changing`
        else:
            self._queue(Remove(job.seq_id))
        self._free_seq_ids.append(job.seq_id)
        self.reserved -= job.reserved

    def drop_tail(self, job: ActiveJob) -> None:
        """Remove a job's KV past n_past: the rows of draft tokens that were not kept."""
        self._queue(Remove(job.seq_id, job.n_past))

    # -- prefix reuse -----------------------------------------------------------------------------

    def reuse_prefix(self, job: ActiveJob, running: Iterable[ActiveJob]) -> Reuse | None:
        """Reuse the KV of the longest shared prefix instead of prefilling it: in place from what
        this slot's last job left, or copied from a prefix entry, another slot's kept KV or a
        running job. Sets job.n_past (and job.reused) to the reused length."""
        kept = self.slot_kv.pop(job.seq_id, None)
        best = self._choose_source(job, kept, running)
        if best is None:
            if kept is not None:
                self._stash(kept)
                self._queue(Remove(job.seq_id))
            return None
        n, source, kind, restore = best
        if kind == "kept":
            # most of what the slot held is cut off (another conversation, sharing a template's
            # first tokens): keep it in host RAM first, with the checkpoints
            key = self._stash(source) if len(source.tokens) - n >= MIN_STASH_TOKENS else None
            if restore:
                self._queue(Restore(job.seq_id, n, job.seq_id if key is None else key))
            self._queue(Remove(job.seq_id, n))
        else:
            if kept is not None:  # the copy goes into an empty sequence
                # stashing it must not evict the RAM entry about to be restored
                self._stash(kept, keep=source.seq_id if kind == "ram" else None)
                self._queue(Remove(job.seq_id))
            if kind == "ram":
                self._queue(Unstash(source.seq_id, job.seq_id))
                self._queue(Remove(job.seq_id, n))
                self.ram.move_to_end(source.seq_id)
                self.ram_reuses += 1
                if source.seq_id in self.from_store:  # its first use: read from the store for this job
                    self.from_store.discard(source.seq_id)
                    job.restored = n
            else:
                self._queue(Copy(source.seq_id, job.seq_id, n))
            if restore:
                self._queue(Restore(job.seq_id, n, source.seq_id))
        self.checkpoint_reuses += restore
        job.n_past = job.reused = n
        self.reused_tokens += n
        if kind == "entry":
            self.prefixes.move_to_end(source.seq_id)
        elif kind == "running" and (self._free_prefix_ids or self.evict_prefix()):
            # a prefix two live jobs share is likely shared by the next one too: keep it
            entry_id = self._free_prefix_ids.pop()
            self._queue(Copy(source.seq_id, entry_id, n))
            if restore:
                self._queue(Restore(entry_id, n, source.seq_id))
            self.prefixes[entry_id] = PrefixEntry(entry_id, job.tokens[:n], source.n_prompt, job.tenant)
        return Reuse(n, kind, source.seq_id)

    def _choose_source(self, job: ActiveJob, kept: PrefixEntry | None, running: Iterable[ActiveJob]
                       ) -> tuple[int, PrefixEntry, ReuseSource, bool] | None:
        """The longest reusable prefix: (its length, where from, what kind, whether it needs a
        checkpoint of the source's windowed layers restored)."""
        sources = list(self._sources(running, job.tenant))
        if kept is not None and kept.tenant == job.tenant:
            sources.insert(0, (kept, "kept"))
        best: tuple[int, PrefixEntry, ReuseSource, bool] | None = None
        for source, kind in sources:
            n, restore = self._reusable(source, job.tokens)
            worth = 1 if kind == "kept" else MIN_SHARED_PREFIX  # in place any token pays
            if n >= worth and n > (best[0] if best else 0):
                best = (n, source, kind, restore)
        return best

    def longest_reusable(self, tokens: Sequence[int], running: Iterable[ActiveJob], enough: int,
                         tenant: str = "") -> int:
        """How many of `tokens` a job could reuse now from a cached prefix, a free slot's kept
        KV, host RAM or a running job; the search stops at the first source with `enough`."""
        best = 0
        for source, _ in self._sources(running, tenant):
            best = max(best, self._reusable(source, tokens)[0])
            if best >= enough:
                break
        return best

    def _sources(self, running: Iterable[ActiveJob], tenant: str
                 ) -> Iterator[tuple[PrefixEntry, ReuseSource]]:
        """The KV a job of `tenant` may reuse: its tenant's only (shared KV is a timing side
        channel between users, and affinity keys promise tenants never share it)."""
        yield from ((e, "entry") for e in self.prefixes.values() if e.tenant == tenant)
        yield from ((e, "other slot") for e in self.slot_kv.values() if e.tenant == tenant)
        yield from ((e, "ram") for e in self.ram.values() if e.tenant == tenant)
        for o in running:
            if o.tenant == tenant:
                yield PrefixEntry(o.seq_id, o.tokens[: o.n_past], len(o.tokens), o.tenant), "running"

    def _reusable(self, source: PrefixEntry, tokens: Sequence[int]) -> tuple[int, bool]:
        """How many of `tokens` can come from `source`'s KV, and whether that needs one of its
        checkpoints restored (its window has moved past the point where they diverge)."""
        n = self._shared(source.tokens, source.n_prompt, tokens)
        if self._window_held(source.seq_id, n):
            return n, False
        if source.seq_id in self._changing:
            return 0, False  # queued operations will change what its checkpoints stand for
        return _checkpoint_at(self.checkpoints.get(source.seq_id, ()), n), True

    def _shared(self, source: Sequence[int], n_prompt: int, tokens: Sequence[int]) -> int:
        # the last prompt token must run, for the first logits
        n = min(common_prefix(source, tokens), len(tokens) - 1)
        return reusable_prefix(n, n_prompt, len(tokens), self.n_batch) if self.invariant else n

    def reusable_stored(self, source: Sequence[int], n_prompt: int, oldest: int, checkpoints: Iterable[int],
                        tokens: Sequence[int]) -> int:
        """How many of `tokens` a stored entry gives (the rule of _reusable, for a state whose
        windowed layers held positions from `oldest` on, with checkpoints at `checkpoints`)."""
        n = self._shared(source, n_prompt, tokens)
        return n if holds_window(oldest, n, self.window) else _checkpoint_at(checkpoints, n)

    def _window_held(self, seq_id: int, n: int) -> bool:
        """Does `seq_id` still hold the window the token at position n attends to? (Windowed
        layers recycle a sequence's cells once its own tokens have moved past them.)"""
        if not self.window:
            return True
        if seq_id < 0:  # a host-RAM entry: as its sequence was when stashed
            return holds_window(self.ram_oldest[seq_id], n, self.window)
        # not read, or queued operations will change what was read
        if seq_id in self._changing or seq_id >= len(self.oldest_held):
            return False
        return holds_window(self.oldest_held[seq_id], n, self.window)

    # -- host RAM ---------------------------------------------------------------------------------

    def adopt(self, entry: PrefixEntry, oldest: int, checkpoints: list[int], size: int) -> int:
        """A state read from the KV store becomes a RAM entry (the executor was given its bytes
        under the id returned): the next job that reuses it is counted as restored."""
        key, self._next_key = self._next_key, self._next_key - 1
        self.ram[key] = PrefixEntry(key, entry.tokens, entry.n_prompt, entry.tenant)
        self.ram_oldest[key] = oldest if self.window else 0
        self.checkpoints[key] = sorted(checkpoints)
        self.stash_sizes[key] = size
        self.from_store.add(key)
        self._fit_ram(0, key)
        return key

    def _stash(self, kept: PrefixEntry, keep: int | None = None) -> int | None:
        """Keep a free slot's KV in host RAM before it is emptied, within the byte budget: the
        entry's id, or None (too short, too big, or no budget). Entry `keep` stays whatever
        the budget or the new entry holds."""
        n = len(kept.tokens)
        if (not self.ram_budget or n < MIN_STASH_TOKENS or kept.seq_id in self._changing
                or self._estimate(n) > self.ram_budget):
            return None
        for key in [k for k, e in self.ram.items()  # what the new entry holds all of
                    if k != keep and len(e.tokens) <= n and e.tenant == kept.tenant
                    and common_prefix(e.tokens, kept.tokens) == len(e.tokens)]:
            self._drop_ram(key)
        key, self._next_key = self._next_key, self._next_key - 1
        self._queue(Stash(kept.seq_id, key))
        self.ram[key] = PrefixEntry(key, kept.tokens, kept.n_prompt, kept.tenant)
        held = self.oldest_held[kept.seq_id] if kept.seq_id < len(self.oldest_held) else 0
        self.ram_oldest[key] = held if self.window else 0
        self.checkpoints[key] = self.checkpoints.pop(kept.seq_id, [])  # the executor moves them too
        self._fit_ram(self._estimate(n), keep)
        return key

    def _estimate(self, n_tokens: int) -> int:
        """Bytes an entry of n_tokens will take, from the sizes of the entries measured so far."""
        sized = [(len(self.ram[k].tokens), b) for k, b in self.stash_sizes.items() if k in self.ram]
        tokens = sum(t for t, _ in sized)
        return sum(b for _, b in sized) * n_tokens // tokens if tokens else 0

    def _fit_ram(self, coming: int = 0, keep: int | None = None) -> None:
        """Drop the least recently used entries while the entries (and `coming` bytes) pass the
        budget; the newest entry stays, and `keep`."""
        while len(self.ram) > 1 and self.ram_bytes() + coming > self.ram_budget:
            oldest = next((k for k in islice(self.ram, len(self.ram) - 1) if k != keep), None)
            if oldest is None:
                return
            self._drop_ram(oldest)

    def _drop_ram(self, key: int) -> None:
        del self.ram[key]
        self.from_store.discard(key)
        self.ram_oldest.pop(key, None)
        self.checkpoints.pop(key, None)
        self.stash_sizes.pop(key, None)  # the executor frees the bytes when it applies the Drop
        self._ops.append(Drop(key))

    def ram_bytes(self) -> int:
        """Bytes of the RAM entries. Stats may be read while a step runs on another thread
        (backend.overlap): the sizes are copied (in C) first."""
        return sum(size for key, size in list(self.stash_sizes.items()) if key in self.ram)


def holds_window(oldest: int, n: int, window: int) -> bool:
    """Does KV whose windowed layers hold positions from `oldest` on serve a prefix of n tokens
    (the window the token at n attends to)? Always, without windowed layers."""
    return not window or oldest <= max(0, n - window)


def _checkpoint_at(positions: Iterable[int], n: int) -> int:
    """The latest checkpoint at or before position n (0: none)."""
    return max((p for p in positions if p <= n), default=0)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share. Compared a block at a time (slices compare in C):
    every admission weighs every kept slot, RAM entry and running job, thousands of tokens each."""
    n = min(len(a), len(b))
    head = min(n, 64)  # most pairs differ early: no copy of whole sequences for them
    if a[:head] == b[:head] and a[:n] == b[:n]:
        return n
    i = 0
    while a[i:i + 64] == b[i:i + 64]:  # they differ before n: this ends
        i += 64
    while a[i] == b[i]:
        i += 1
    return i
