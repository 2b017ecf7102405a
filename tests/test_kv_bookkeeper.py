"""The KV bookkeeper without a model: sequence ids, kept KV, prefix reuse choices, the prefix LRU
and reservations in the unified pool. The KV operations it queues are what llama.cpp will do."""

from __future__ import annotations

from backends.llamacpp.kv import (
    MIN_CHECKPOINT_PROMPT,
    MIN_SLOT_CHOICE_PREFIX,
    MIN_STASH_TOKENS,
    Copy,
    Drop,
    KvBookkeeper,
    PrefixEntry,
    Remove,
    Restore,
    Reuse,
    Save,
    Stash,
    Unstash,
)
from backends.llamacpp.state import ActiveJob, WaitingJob
from tests.engine_state import prompt, sampling


def bookkeeper(*, slots: int = 4, prefix_cache: int = 2, n_ctx: int = 4096,
               per_slot: bool = True, invariant: bool = False, ram_budget: int = 0) -> KvBookkeeper:
    return KvBookkeeper(slots=slots, prefix_cache=prefix_cache, n_ctx=n_ctx, n_batch=512,
                        per_slot=per_slot, invariant=invariant, ram_budget=ram_budget)


def start(kv: KvBookkeeper, job_id: str, tokens: list[int], running: list[ActiveJob] | None = None,
          need: int = 64) -> tuple[ActiveJob, Reuse | None]:
    seq_id = kv.allocate(need, tokens)
    assert seq_id is not None
    job = ActiveJob.start(WaitingJob(job_id, tokens, sampling()), seq_id, need)
    return job, kv.reuse_prefix(job, running or [])


def prefilled(job: ActiveJob, output: tuple[int, ...] = ()) -> ActiveJob:
    job.output = list(output)
    job.n_past = len(job.tokens) + max(len(job.output) - 1, 0)  # the last sampled token is not fed yet
    return job


def test_lowest_free_slot_first() -> None:
    kv = bookkeeper()
    jobs = [start(kv, f"j{i}", prompt(10, 100 * i))[0] for i in range(3)]
    assert [j.seq_id for j in jobs] == [0, 1, 2]
    kv.release(jobs[1])
    kv.release(jobs[0])
    assert kv.allocate(1) == 0 and kv.allocate(1) == 1 and kv.allocate(1) == 3
    assert kv.allocate(1) is None  # four slots busy; prefix ids are never given to jobs


def test_next_turn_reuses_the_slots_kept_kv_in_place() -> None:
    kv = bookkeeper()
    turn1, _ = start(kv, "turn1", prompt(20))
    kv.release(prefilled(turn1, output=(7, 8, 9, 10, 11)))
    assert kv.take_ops() == []  # a per-slot stream keeps its KV for the slot's next job
    assert kv.slot_kv[0].tokens == [*prompt(20), 7, 8, 9, 10]
    turn2, reuse = start(kv, "turn2", [*prompt(20), 7, 8, 9, 10, *prompt(10, 9000)])
    assert reuse == Reuse(24, "kept", 0) and turn2.n_past == 24
    assert kv.take_ops() == [Remove(0, 24)]  # in place: only the tail past the shared prefix goes
    assert kv.reused_tokens == 24 and not kv.slot_kv


def test_kept_kv_with_nothing_shared_is_dropped() -> None:
    kv = bookkeeper()
    first, _ = start(kv, "a", prompt(20))
    kv.release(prefilled(first))
    _, reuse = start(kv, "b", prompt(20, 5000))
    assert reuse is None and kv.take_ops() == [Remove(0)]


def test_a_copy_must_share_eight_tokens_in_place_one_is_enough() -> None:
    kv = bookkeeper(per_slot=False)
    a = prefilled(start(kv, "a", prompt(20))[0])
    _, seven = start(kv, "b", prompt(7) + prompt(13, 5000), running=[a])
    assert seven is None and kv.take_ops() == []
    c, eight = start(kv, "c", prompt(8) + prompt(12, 5000), running=[a])
    assert eight == Reuse(8, "running", 0) and c.n_past == 8
    # two live jobs share it: the prefix is kept in a spare sequence id for the next one
    assert kv.take_ops() == [Copy(0, c.seq_id, 8), Copy(0, 5, 8)]
    assert list(kv.prefixes) == [5] and kv.prefixes[5].tokens == prompt(8)

    kv = bookkeeper()
    first = prefilled(start(kv, "a", prompt(20))[0])
    kv.release(first)
    _, one = start(kv, "b", prompt(1) + prompt(19, 5000))
    assert one == Reuse(1, "kept", 0)


def test_the_longest_shared_prefix_wins() -> None:
    kv = bookkeeper(per_slot=False)
    a = prefilled(start(kv, "a", prompt(30))[0])
    b = prefilled(start(kv, "b", prompt(12) + prompt(18, 7000))[0])
    kv.take_ops()
    c, reuse = start(kv, "c", prompt(25) + prompt(5, 9000), running=[a, b])
    assert reuse == Reuse(25, "running", a.seq_id) and c.n_past == 25


def test_the_last_prompt_token_always_runs() -> None:
    kv = bookkeeper(per_slot=False)
    a = prefilled(start(kv, "a", prompt(30))[0])
    _, reuse = start(kv, "again", prompt(30), running=[a])
    assert reuse is not None and reuse.n_tokens == 29  # its logits give the first token


def test_batch_invariance_limits_what_may_be_reused() -> None:
    """The source prefilled 40 tokens row by row; a 300-token prompt alone tiles them."""
    for invariant, expected in [(True, None), (False, 30)]:
        kv = bookkeeper(invariant=invariant)
        a = prefilled(start(kv, "a", prompt(40))[0])
        _, reuse = start(kv, "b", prompt(30) + prompt(270, 5000), running=[a])
        assert (reuse.n_tokens if reuse else None) == expected, invariant


def test_another_slots_kept_kv_is_copied() -> None:
    kv = bookkeeper()
    a, _ = start(kv, "a", prompt(20))
    b, _ = start(kv, "b", prompt(20, 5000))
    kv.release(prefilled(a))
    kv.release(prefilled(b))
    c, reuse = start(kv, "c", prompt(15, 5000) + prompt(5, 9000))  # gets slot 0, shares b's
    assert c.seq_id == 0 and reuse == Reuse(15, "other slot", 1)
    assert kv.take_ops() == [Remove(0), Copy(1, 0, 15)]  # slot 0's own kept KV goes first
    assert list(kv.slot_kv) == [1]


def test_prefix_entries_are_an_lru() -> None:
    kv = bookkeeper(slots=6, per_slot=False)
    x = prefilled(start(kv, "x", prompt(20, 0))[0])
    start(kv, "x2", prompt(20, 0), running=[x])  # entry 7 <- x's prefix
    y = prefilled(start(kv, "y", prompt(20, 5000))[0])
    start(kv, "y2", prompt(20, 5000), running=[y])  # entry 6 <- y's prefix
    assert list(kv.prefixes) == [7, 6]
    _, reuse = start(kv, "x3", prompt(20, 0))
    assert reuse == Reuse(19, "entry", 7) and list(kv.prefixes) == [6, 7]  # used: now newest
    kv.take_ops()
    assert kv.evict_prefix() and kv.take_ops() == [Remove(6)] and list(kv.prefixes) == [7]


def test_unified_pool_reservations_evict_cached_prefixes_before_deferring() -> None:
    kv = bookkeeper(slots=4, n_ctx=256, per_slot=False)
    a = prefilled(start(kv, "a", prompt(60), need=100)[0])
    start(kv, "b", prompt(60), running=[a], need=100)  # caches a 59-token prefix entry
    kv.take_ops()
    assert kv.reserved == 200 and kv.prefix_cells() == 59
    assert not kv.fits(40)  # 200 + 40 + 59 > 256
    assert kv.allocate(40) is not None  # room made by evicting the prefix entry
    assert kv.take_ops() == [Remove(5)] and not kv.prefixes
    assert kv.allocate(40) is None  # nothing left to evict: the job waits, running jobs keep theirs
    kv.release(a)
    assert kv.take_ops() == [Remove(a.seq_id)] and kv.reserved == 140
    assert kv.allocate(40) is not None


def test_a_failed_job_drops_its_kv_even_with_per_slot_streams() -> None:
    kv = bookkeeper()
    a, _ = start(kv, "a", prompt(20))
    kv.release(prefilled(a), keep_kv=False)
    assert kv.take_ops() == [Remove(0)] and not kv.slot_kv and kv.reserved == 0


def windowed(oldest: dict[int, int] | None = None) -> KvBookkeeper:
    """Per-slot streams whose sliding-window layers keep 512 positions; oldest[seq_id] is the
    first position a sequence still holds (what llama_memory_seq_pos_min reports); None: no
    window (every position kept)."""
    if oldest is None:
        return bookkeeper()
    kv = KvBookkeeper(slots=4, prefix_cache=2, n_ctx=4096, n_batch=512, per_slot=True, window=512)
    kv.oldest_held = [oldest.get(seq_id, 0) for seq_id in range(kv.n_streams)]
    return kv


def next_turn(kv: KvBookkeeper, first: int, shared: int) -> Reuse | None:
    """A job of `first` prompt tokens (and 40 out) ends on slot 0; the next one shares `shared`."""
    job, _ = start(kv, "a", prompt(first))
    kv.release(prefilled(job, output=tuple(range(40))))
    kv.take_ops()
    return start(kv, "b", [*prompt(shared), *prompt(20, 9000)])[1]


def test_a_prefix_inside_the_window_is_reused() -> None:
    assert next_turn(windowed({0: 0}), 300, 300) == next_turn(windowed(), 300, 300) is not None


def test_a_prefix_whose_window_was_recycled_is_prefilled_again() -> None:
    # the slot's last job ran to position 1,339: its windowed layers hold 800.. only, so the
    # 700 tokens a newcomer shares with it lack positions 188..799 of their window
    assert next_turn(windowed(), 1300, 700) is not None
    kv = windowed({0: 800})
    assert next_turn(kv, 1300, 700) is None and kv.take_ops() == [Remove(0)]


def test_a_long_shared_prefix_needs_only_the_window_before_its_end() -> None:
    reuse = next_turn(windowed({0: 700}), 1300, 1300)
    assert reuse == next_turn(windowed(), 1300, 1300) and reuse is not None
    assert reuse.n_tokens - 512 >= 700  # the window before the reuse's end is held


def test_a_sequence_with_queued_changes_is_not_a_source_while_windowed() -> None:
    # b copies a's prefix into slot 1 (queued, not applied yet): llama.cpp cannot say yet what
    # slot 1 will hold, so c does not take the prefix from b in the same round
    kv = windowed({})
    a, _ = start(kv, "a", prompt(100))
    a = prefilled(a)
    b, reuse_b = start(kv, "b", [*prompt(100), 1], [a])
    assert reuse_b is not None and reuse_b.from_seq_id == a.seq_id
    _, reuse_c = start(kv, "c", [*prompt(100), 2], [b])
    assert reuse_c is None


def windowed_turn(kv: KvBookkeeper, first: int) -> ActiveJob:
    """A job of `first` prompt tokens on slot 0: its prompt done (checkpointed), 400 tokens out."""
    job, _ = start(kv, "a", prompt(first))
    job.n_past = len(job.tokens)
    kv.prompt_done(job)
    kv.release(prefilled(job, output=tuple(range(7000, 7400))))
    return job


def test_a_prompt_end_is_checkpointed_when_layers_keep_only_their_window() -> None:
    kv = windowed({})
    windowed_turn(kv, 300)
    assert kv.take_ops() == [Save(0, 300)] and kv.checkpoints == {0: [300]}
    no_window = bookkeeper()
    windowed_turn(no_window, 300)
    assert no_window.take_ops() == []  # every position kept: nothing to checkpoint
    short = windowed({})
    windowed_turn(short, MIN_CHECKPOINT_PROMPT - 1)
    assert short.take_ops() == []


def test_an_edited_answer_reuses_the_history_through_the_checkpoint() -> None:
    # the slot ran to position 700; its window holds 188.. only. The next turn shares the prompt
    # (300 tokens) but not the answer (the client edited it): without the checkpoint, positions
    # before 300 have no window left, and the whole history would be prefilled again
    kv = windowed({0: 188})
    windowed_turn(kv, 300)
    kv.take_ops()
    job, reuse = start(kv, "b", [*prompt(300), *prompt(50, 9000)])
    assert reuse == Reuse(300, "kept", 0) and job.n_past == 300 and kv.checkpoint_reuses == 1
    assert kv.take_ops() == [Restore(0, 300, 0), Remove(0, 300)]
    assert kv.checkpoints == {0: [300]}  # the Remove from 300 keeps the checkpoint at 300


def test_a_checkpoint_past_the_shared_prefix_is_not_used_and_a_tail_removal_drops_it() -> None:
    kv = windowed({0: 188})
    windowed_turn(kv, 300)
    kv.take_ops()
    _, reuse = start(kv, "b", [*prompt(200), *prompt(50, 9000)])
    assert reuse is None and kv.take_ops() == [Remove(0)] and kv.checkpoints == {0: []}


def test_a_checkpoint_serves_a_copy_into_another_slot() -> None:
    kv = windowed({0: 188})
    windowed_turn(kv, 300)
    kv.take_ops()
    x, _ = start(kv, "x", [*prompt(300), *prompt(50, 9000)])  # in place, through the checkpoint
    kv.take_ops()
    y, reuse = start(kv, "y", [*prompt(300), *prompt(50, 8000)], [x])  # x still runs in slot 0
    assert y.seq_id == 1 and reuse == Reuse(300, "running", 0)
    # and the prefix both share is kept as an entry, its window restored the same way
    assert kv.take_ops() == [Copy(0, 1, 300), Restore(1, 300, 0), Copy(0, 5, 300), Restore(5, 300, 0)]


def test_a_returning_prompt_gets_the_free_slot_that_holds_its_history() -> None:
    kv = bookkeeper()
    a, _ = start(kv, "a", prompt(100))
    b, _ = start(kv, "b", prompt(100, 5000))
    kv.release(prefilled(a, output=(1, 2, 3)))
    kv.release(prefilled(b, output=(4, 5, 6)))
    kv.take_ops()
    job, reuse = start(kv, "b2", [*prompt(100, 5000), 4, 5, *prompt(20, 9000)])
    assert job.seq_id == 1 and reuse == Reuse(102, "kept", 1)  # not slot 0, the lowest free id
    short, _ = start(kv, "c", [*prompt(MIN_SLOT_CHOICE_PREFIX - 2), *prompt(5, 9000)])
    assert short.seq_id == 0  # a short shared prefix is not worth a gap: the lowest free id


# -- host RAM ---------------------------------------------------------------------------------------


def conversation(i: int, n: int = 100) -> list[int]:
    return prompt(n, 10_000 * (i + 1))


def test_a_slots_kv_another_conversation_replaces_is_stashed_and_found_again() -> None:
    kv = bookkeeper(slots=1, prefix_cache=0, ram_budget=1 << 30)
    a, _ = start(kv, "a1", conversation(0))
    kv.release(prefilled(a, output=(7, 8)))
    b, reuse = start(kv, "b", conversation(1))  # nothing shared: a's KV goes to RAM first
    assert reuse is None and kv.take_ops() == [Stash(0, -1), Remove(0)]
    kv.release(prefilled(b))
    a2, reuse = start(kv, "a2", [*conversation(0), 7, *prompt(5, 50)])
    assert reuse == Reuse(101, "ram", -1) and a2.n_past == 101
    # b's KV is stashed in turn, the slot emptied, a's state put back and cut to what is shared
    assert kv.take_ops() == [Stash(0, -2), Remove(0), Unstash(-1, 0), Remove(0, 101)]
    assert kv.ram_reuses == 1 and list(kv.ram) == [-2, -1]  # a's entry is the most recently used


def test_short_sequences_are_not_stashed_nor_is_anything_without_a_budget() -> None:
    for budget, n, stashed in ((1 << 30, MIN_STASH_TOKENS - 1, False), (0, 500, False), (1 << 30, 500, True)):
        kv = bookkeeper(slots=1, prefix_cache=0, ram_budget=budget)
        a, _ = start(kv, "a", conversation(0, n))
        kv.release(prefilled(a))
        start(kv, "b", conversation(1))
        assert any(isinstance(op, Stash) for op in kv.take_ops()) == stashed, (budget, n)


def test_the_ram_entries_are_an_lru_within_the_byte_budget() -> None:
    kv = bookkeeper(slots=1, prefix_cache=0, ram_budget=250)
    drops = []
    for i in range(5):  # each conversation's KV replaced by the next one's (stashed)
        job, _ = start(kv, f"c{i}", conversation(i))
        drops += [op.key for op in kv.take_ops() if isinstance(op, Drop)]
        kv.stash_sizes.update({k: 100 for k in kv.ram})  # what the executor measured
        kv.release(prefilled(job))
    # 100 bytes each, 250 allowed: each stash past two entries evicts the least recently used
    assert list(kv.ram) == [-3, -4] and drops == [-1, -2] and kv.ram_bytes() == 200


def test_the_entry_a_newcomer_restores_is_not_evicted_by_stashing_its_slots_kv() -> None:
    kv = bookkeeper(slots=1, prefix_cache=0, ram_budget=250)
    for i in range(3):  # conversations 0 and 1 in RAM (-1, -2: the budget's two), 2 in the slot
        job, _ = start(kv, f"c{i}", conversation(i))
        kv.take_ops()
        kv.stash_sizes.update({k: 100 for k in kv.ram})
        kv.release(prefilled(job))
    # conversation 0 returns: its entry is the least recently used one, and stashing the slot's
    # KV (conversation 2) must evict one to fit the budget: conversation 1's, not the one restored
    _, reuse = start(kv, "c0 again", [*conversation(0), *prompt(20, 90)])
    assert reuse == Reuse(100, "ram", -1)
    ops = kv.take_ops()
    assert ops == [Stash(0, -3), Drop(-2), Remove(0), Unstash(-1, 0), Remove(0, 100)]
    assert list(kv.ram) == [-3, -1]


def test_the_entry_a_newcomer_restores_stays_though_the_slots_kv_holds_all_of_it() -> None:
    # the slot's KV holds the entry's tokens and more, but its window moved on past the point the
    # newcomer's prompt leaves it: the entry (whose window is held) is the source
    kv = KvBookkeeper(slots=1, prefix_cache=0, n_ctx=4096, n_batch=512, per_slot=True, window=512,
                      ram_budget=1 << 30)
    kv.oldest_held = [0] * kv.n_streams
    a, _ = start(kv, "a", conversation(0, 600))
    kv.release(prefilled(a))
    b, _ = start(kv, "b", conversation(1))  # conversation 0 stashed as -1, window from 0
    kv.take_ops()
    kv.release(prefilled(b))
    kv.slot_kv[0] = PrefixEntry(0, [*conversation(0, 600), *prompt(900, 77)], 600)
    kv.oldest_held = [1000] * kv.n_streams  # the slot's window holds positions 1000.. only
    _, reuse = start(kv, "a again", [*conversation(0, 600), *prompt(10, 5)])
    assert reuse == Reuse(600, "ram", -1)
    assert [type(op).__name__ for op in kv.take_ops()] == ["Stash", "Remove", "Unstash", "Remove"]
    assert -1 in kv.ram


def test_an_entry_the_newer_one_holds_all_of_is_dropped() -> None:
    kv = bookkeeper(slots=1, prefix_cache=0, ram_budget=1 << 30)
    a, _ = start(kv, "a1", conversation(0))
    kv.release(prefilled(a))
    b, _ = start(kv, "b", conversation(1))  # a's 100 tokens stashed as -1
    kv.take_ops()
    kv.release(prefilled(b))
    a2, reuse = start(kv, "a2", [*conversation(0), *prompt(30, 70)])  # b stashed (-2), a restored
    assert reuse is not None and reuse.source == "ram"
    kv.take_ops()
    kv.release(prefilled(a2))
    start(kv, "c", conversation(2))  # a's 130 tokens stashed: the 100-token entry goes
    assert [op for op in kv.take_ops() if isinstance(op, Drop)] == [Drop(-1)]
    assert [len(e.tokens) for e in kv.ram.values()] == [100, 130]  # b's, then a's longer one
