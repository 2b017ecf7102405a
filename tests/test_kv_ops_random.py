"""Random conversations through the scheduler and the KV bookkeeper, without a model: every KV
operation they queue must be one the executor can carry out at that point of the stream (a
host-RAM entry restored must still be there, a checkpoint restored must have been saved and not
dropped). The executor fails a whole step, or a job's start, on any other."""

from __future__ import annotations

import random

import pytest

from backends.llamacpp.kv import Copy, Drop, KvBookkeeper, KvOp, Remove, Restore, Save, Stash, Unstash
from backends.llamacpp.scheduler import Scheduler
from tests.engine_state import sampled_sevens, sampling

WINDOW = 512


class ExecutorState:
    """What the executor keeps beside llama.cpp's KV: RAM entries and checkpoints, by key."""

    def __init__(self) -> None:
        self.ram: set[int] = set()
        self.checkpoints: set[tuple[int, int]] = set()

    def apply(self, ops: list[KvOp]) -> None:
        for op in ops:
            if isinstance(op, Remove):
                self.checkpoints = {(s, p) for s, p in self.checkpoints
                                    if s != op.seq_id or (op.start >= 0 and p <= op.start)}
            elif isinstance(op, Save):
                self.checkpoints.discard((op.seq_id, op.forget if op.forget is not None else -1))
                self.checkpoints.add((op.seq_id, op.pos))
            elif isinstance(op, Stash):
                self.ram.add(op.key)
                self.checkpoints = {(op.key if s == op.seq_id else s, p) for s, p in self.checkpoints}
            elif isinstance(op, Unstash):
                assert op.key in self.ram, f"{op}: the entry is gone"
            elif isinstance(op, Restore):
                assert (op.src, op.pos) in self.checkpoints, f"{op}: no such checkpoint"
            elif isinstance(op, Drop):
                self.ram.discard(op.key)
                self.checkpoints = {(s, p) for s, p in self.checkpoints if s != op.key}
            else:
                assert isinstance(op, Copy)


def oldest_held(s: Scheduler) -> list[int]:
    """A window of WINDOW positions: what each sequence's windowed layers still hold."""
    kv = s.kv
    length = {e.seq_id: len(e.tokens) for e in (*kv.prefixes.values(), *kv.slot_kv.values())}
    length.update((j.seq_id, j.n_past) for j in s.active.values())
    return [max(0, length.get(i, 0) - WINDOW) for i in range(kv.n_streams)]


@pytest.mark.parametrize("seed", range(6))
def test_random_conversations_queue_only_operations_the_executor_can_carry_out(seed: int) -> None:
    rng = random.Random(seed)
    kv = KvBookkeeper(slots=3, prefix_cache=2, n_ctx=3 * 2048, n_batch=512, per_slot=True,
                      window=WINDOW, ram_budget=350, checkpoints=1)
    s = Scheduler(kv, n_batch=512, n_ctx_per_seq=2048)
    executor = ExecutorState()
    system = [rng.randrange(1000) for _ in range(120)]
    chats = [system + [rng.randrange(1000) for _ in range(rng.randint(5, 60))] for _ in range(6)]
    restored = 0
    for n in range(400):
        while s.free_slots() and rng.random() < 0.6:
            c = rng.randrange(len(chats))
            if rng.random() < 0.3:  # an edited answer: the history's end is rewritten
                chats[c] = chats[c][:max(10, len(chats[c]) - rng.randint(5, 150))]
            chats[c] = (chats[c] + [rng.randrange(1000) for _ in range(rng.randint(3, 200))])[-1500:]
            s.enqueue(f"j{n}-{c}", list(chats[c]), sampling(rng.randint(1, 40)))
        if s.active and rng.random() < 0.05:  # cancelled
            s.release(rng.choice(list(s.active.values())), keep_kv=rng.random() < 0.5)
        plan = s.admission_round(oldest_held(s))
        executor.apply(plan.kv_ops)
        restored += sum(isinstance(op, Unstash) for op in plan.kv_ops)
        if s.active:
            plan = s.plan_step()
            executor.apply(plan.kv_ops)
            for call in plan.calls:  # as the engine does: each call's update, then its KV ops
                executor.apply(s.update(call, sampled_sevens(call)).kv_ops)
            s.end_step()
        kv.stash_sizes.update({k: 100 for k in kv.ram if k not in kv.stash_sizes})  # as measured
    assert restored  # the run went through host RAM
