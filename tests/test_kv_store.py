"""The KV store (backends/llamacpp/kv_store.py) on real files: entries a host's workers share,
restored only by the same model, settings, build and tenant; a bad file is removed and never
restored; a full disk, or two writers of one key at once, break nothing. And on the real model:
a conversation restored from the store answers as a fresh prefill does."""

from __future__ import annotations

import multiprocessing
import os
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.base import Done, Token
from backends.contract.schema import GenerateRequest, Message
from backends.llamacpp import LlamaCppBackend
from backends.llamacpp.engine import GATHER_READS_SECONDS
from backends.llamacpp.kv import KvBookkeeper, common_prefix, holds_window
from backends.llamacpp.kv_store import _PREFIX, SUFFIX, Entry, Header, KvStore, StoreWriter, store_id
from backends.llamacpp.scheduler import Scheduler
from backends.llamacpp_settings import KvStoreSettings, LlamaCppSettings
from tests.engine_state import execute, prompt, sampling
from tests.test_chat_checkpoints import N_BATCH, TIE, margin, run
from worker.claiming.models import kv_store_of
from worker.settings import FleetSettings

IDENTITY = {"model_sha256": "ab" * 32, "model_bytes": 1234, "llama_cpp": "0.3.36", "n_ctx_seq": 4096}


def entry(tenant: str = "a", n: int = 300, state_bytes: int = 4096, first: int = 1000) -> Entry:
    state = bytes(i % 251 for i in range(state_bytes))
    return Entry(tenant, prompt(n, first), n - 20, 0, state, [(n - 20, b"checkpoint" * 10)])


def find(store: KvStore, tenant: str, job: list[int]) -> tuple[Entry, int] | None:
    """The entry sharing the longest prefix with `job` (the engine's rule, without a window)."""
    return store.find(tenant, job, lambda h: common_prefix(h.tokens, job))


def files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_an_entry_comes_back_whole_for_its_tenant_only(tmp_path: Path) -> None:
    store = KvStore(tmp_path, IDENTITY, budget_bytes=1 << 30)
    written = entry()
    store.write(written)
    [path] = files(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.name.endswith(SUFFIX)
    job = [*written.tokens, 5, 6, 7]  # the next turn starts with the stored prompt
    found = find(KvStore(tmp_path, IDENTITY, budget_bytes=1 << 30), "a", job)
    assert found is not None
    got, n = found
    assert n == 300 and got.tokens == written.tokens and bytes(got.state) == written.state
    assert [(p, bytes(d)) for p, d in got.checkpoints] == [(280, b"checkpoint" * 10)]
    # another tenant with the very same tokens finds nothing, and learns nothing: no file of its own
    other = KvStore(tmp_path, IDENTITY, budget_bytes=1 << 30)
    assert find(other, "b", job) is None and not other.bucket("b").exists()
    assert files(tmp_path) == [path]
    # another model (or settings, or build) lists another bucket
    swapped = KvStore(tmp_path, {**IDENTITY, "model_bytes": 1235}, budget_bytes=1 << 30)
    assert find(swapped, "a", job) is None


@pytest.mark.parametrize("damage", ["truncated payload", "truncated header", "flipped payload byte",
                                    "foreign identity", "not an entry"])
def test_a_bad_file_is_removed_and_never_restored(tmp_path: Path, damage: str,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    store = KvStore(tmp_path, IDENTITY, budget_bytes=1 << 30)
    store.write(entry())
    [path] = files(tmp_path)
    data = path.read_bytes()
    if damage == "truncated payload":
        path.write_bytes(data[:-100])
    elif damage == "truncated header":
        path.write_bytes(data[:40])
    elif damage == "flipped payload byte":
        path.write_bytes(data[:-50] + bytes([data[-50] ^ 1]) + data[-49:])
    elif damage == "foreign identity":  # another model's entry under this one's name
        foreign = KvStore(tmp_path / "x", {**IDENTITY, "model_sha256": "cd" * 32}, budget_bytes=1 << 30)
        foreign.write(entry())
        path.write_bytes(files(tmp_path / "x")[0].read_bytes())
    else:
        path.write_bytes(b"\0" * 5000)
    fresh = KvStore(tmp_path, IDENTITY, budget_bytes=1 << 30)
    job = [*entry().tokens, 1]
    assert find(fresh, "a", job) is None
    assert not path.exists() and fresh.stats.removed_bad == 1 and fresh.stats.restores == 0
    assert find(fresh, "a", job) is None  # and once gone, nothing more to say
    assert sum(str(path) in r.message for r in caplog.records) == 1


def test_the_longest_shared_prefix_wins_and_a_longer_entry_replaces_what_it_holds(tmp_path: Path) -> None:
    store = KvStore(tmp_path, IDENTITY, budget_bytes=1 << 30)
    store.write(entry(n=100))
    store.write(entry(n=200, first=5000))  # another conversation
    store.write(entry(n=300))  # turn 2 of the first: holds all of the n=100 entry
    assert len(files(tmp_path)) == 2
    found = store.find("a", prompt(250), lambda h: min(len(h.tokens), 250) if h.tokens[0] == 1000 else 0)
    assert found is not None and found[1] == 250 and len(found[0].tokens) == 300


def test_the_least_recently_used_go_past_the_budget(tmp_path: Path) -> None:
    store = KvStore(tmp_path, IDENTITY, budget_bytes=1 << 30)
    for i in range(3):
        store.write(entry(first=10_000 * (i + 1)))
        os.utime(store.path_of("a", prompt(300, 10_000 * (i + 1))), (1000 + i, 1000 + i))
    store.budget_bytes = sum(p.stat().st_size for p in files(tmp_path))  # room for three
    # the oldest is restored (touched now): the second is the least recently used
    assert find(store, "a", [*prompt(300, 10_000), 1]) is not None
    store.write(entry(first=40_000))
    left = files(tmp_path)
    assert store.stats.evicted == 1 and len(left) == 3
    assert store.path_of("a", prompt(300, 20_000)) not in left
    assert store.path_of("a", prompt(300, 10_000)) in left
    # a file another worker evicted is forgotten at the next lookup: the cache holds what the disk does
    other = KvStore(tmp_path, IDENTITY, budget_bytes=1 << 30)
    assert find(other, "a", [*prompt(300, 30_000), 1]) is not None
    store.path_of("a", prompt(300, 30_000)).unlink()
    assert find(store, "a", [*prompt(300, 10_000), 1]) is not None
    assert all(p.exists() for p in store._headers)


def _write_many(root: str, seed: int) -> None:
    store = KvStore(Path(root), IDENTITY, budget_bytes=1 << 30)
    for _ in range(20):
        store.write(entry(state_bytes=2 << 20))


def test_two_writers_of_one_key_at_once_leave_one_valid_file(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_write_many, args=(str(tmp_path), i)) for i in range(2)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(120)
        assert w.exitcode == 0
    assert len(files(tmp_path)) == 1  # no temp file left, one entry
    found = find(KvStore(tmp_path, IDENTITY, budget_bytes=1 << 30), "a", [*prompt(300), 1])
    assert found is not None and len(found[0].state) == 2 << 20


def _store_id(root: str, out: Any) -> None:
    out.put(store_id(Path(root)))


def test_every_worker_that_opens_a_directory_names_one_store(tmp_path: Path) -> None:
    """The claim sends a busy holder's jobs to the workers of its store by this id: processes
    racing to create it agree, a damaged id file is replaced, another directory is another store."""
    root = tmp_path / "kv"
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    racers = [ctx.Process(target=_store_id, args=(str(root), out)) for _ in range(6)]
    for r in racers:
        r.start()
    ids = {out.get(timeout=60) for _ in racers}
    for r in racers:
        r.join(60)
    assert len(ids) == 1 and ids == {store_id(root)} and len(ids.pop()) == 32
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert [p.name for p in root.iterdir()] == [".store-id"]  # no temp file left
    assert store_id(tmp_path / "other") != store_id(root)
    (root / ".store-id").write_text("../../not an id\n")
    fresh = store_id(root)
    assert fresh == store_id(root) and all(c in "0123456789abcdef" for c in fresh)


def test_a_worker_claims_with_its_store_id_only_where_its_engine_has_a_store(tmp_path: Path) -> None:
    def settings(**kv: Any) -> FleetSettings:
        return FleetSettings.model_validate({"backend": {"type": "llama-cpp", **kv}})
    assert kv_store_of(settings()) == ""
    assert kv_store_of(settings(kv_store={"path": str(tmp_path)})) == store_id(tmp_path)
    assert kv_store_of(settings(kv_store={"path": str(tmp_path)}, kv_unified=True)) == ""  # no store then
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert kv_store_of(settings(kv_store={"path": str(blocked / "kv")})) == ""  # cannot be made: none


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs: writes past it fail with ENOSPC."""
    where = tmp_path / "disk"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_drops_the_entry_and_the_next_one_that_fits_is_written(small_disk: Path) -> None:
    store = KvStore(small_disk, IDENTITY, budget_bytes=1 << 30)
    writer = StoreWriter(store)
    assert writer.put(entry(state_bytes=3 << 20))  # does not fit the disk
    assert writer.flush(30)
    assert store.stats.write_errors == 1 and store.stats.written == 0
    assert files(small_disk) == []  # its partial temp file is gone
    assert writer.put(entry(state_bytes=100_000, first=9000))
    assert writer.close(30)
    assert store.stats.written == 1 and len(files(small_disk)) == 1


def test_a_full_queue_drops_entries_and_counts_them(tmp_path: Path) -> None:
    store = KvStore(tmp_path, IDENTITY, budget_bytes=1 << 30)
    writer = StoreWriter(store, max_queued=1)
    state = bytes(8 << 20)
    entries = [Entry("a", prompt(300, 1000 * i), 280, 0, state) for i in range(1, 30)]
    results = [writer.put(e) for e in entries]  # faster than 8 MB files are written
    assert writer.close(60)
    assert not all(results) and store.stats.dropped == results.count(False)
    assert store.stats.written == results.count(True)


def test_the_engine_reuses_no_kv_across_tenants() -> None:
    # one slot, the RAM cache on: tenant a's KV is stashed when the intruder takes the slot
    kv = KvBookkeeper(slots=1, prefix_cache=2, n_ctx=16384, n_batch=512, per_slot=True, ram_budget=1 << 30)
    s = Scheduler(kv, n_batch=512, n_ctx_per_seq=4096)
    for tenant, job_id in (("a", "first"), ("b", "intruder"), ("a", "again")):
        s.enqueue(job_id, prompt(200), sampling(), tenant=tenant)
        [job] = s.start_waiting()
        assert job.reused == (0 if job_id != "again" else 199), job_id
        while job.done is None:
            execute(s, s.plan_step())


# -- on the real model -------------------------------------------------------------------------------

FACTS = " ".join(f"Fact {i}: river {i} flows north past the town of Alder{i}." for i in range(10))


def store_engine(root: Path | None, **settings: object) -> LlamaCppBackend:
    store = KvStoreSettings(path=root, min_tokens=64)
    # one thread per core it may run on (one in a pinned pytest worker: two would spin on it)
    return LlamaCppBackend(LlamaCppSettings(slots=2, n_batch=N_BATCH, prefix_cache=0, draft_max=0,
                                            kv_store=store, **settings))


def first_turn(engine: LlamaCppBackend) -> list[Message]:
    """Turn 1 of tenant a's chat: its history with the answer."""
    history = [Message(role="user", content=FACTS + "\nName the town of river 3.")]
    answer, _ = run(engine, "turn-1", GenerateRequest(messages=history, max_tokens=16, temperature=0.0,
                                                      tenant="a"))
    return [*history, Message(role="assistant", content=answer)]


def second_turn(history: list[Message], tenant: str = "a") -> GenerateRequest:
    return GenerateRequest(messages=[*history, Message(role="user", content="And of river 7? One word.")],
                           max_tokens=16, temperature=0.0, logprobs=True, top_logprobs=2, tenant=tenant)


def done_of(engine: LlamaCppBackend, job_id: str, request: GenerateRequest) -> tuple[Done, list[Any]]:
    engine.admit(job_id, request)
    return done_of_started(engine, job_id)


def same_answer(warm: list[Any], cold: list[Any]) -> None:
    """The same tokens up to the first near-tie, where the model is sure of each. Not their
    log-probabilities within a bound: the restored history's answer tokens were computed one a
    step, the cold prefill's in one batch, and how far that moves a log-probability depends on
    the CPU's kernels (0.18 nats on AMD EPYC AVX2 in the suite, under 0.1 alone); a wrong or
    foreign state changes the tokens themselves."""
    assert warm and cold
    compared = 0
    for w, c in zip(warm, cold, strict=False):
        if min(margin(w), margin(c)) < TIE:
            break
        assert w["token"] == c["token"], (w, c)
        compared += 1
    gap = max(abs(w["logprob"] - c["logprob"]) for w, c in zip(warm, cold, strict=False))
    print(f"\nlargest log-probability gap, restored vs cold: {gap:.3f} nats")
    assert compared >= 4, f"a near-tie after {compared} tokens: too short to say anything"


@pytest.mark.model
def test_a_conversation_restored_from_the_store_answers_as_a_fresh_prefill(tmp_path: Path) -> None:
    writer = store_engine(tmp_path)
    try:
        history = first_turn(writer)
    finally:
        writer.close()  # a drain's or an unload's last act: turn 1's KV goes to the store
    [path] = files(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    reader = store_engine(tmp_path)  # another worker, or this one restarted
    try:
        restored, warm = done_of(reader, "turn-2", second_turn(history))
        stats = reader.stats()
        # another tenant sending the same chat finds nothing: not in the store, nor in this
        # engine's KV, which now holds tenant a's history
        intruder, cold = done_of(reader, "intruder", second_turn(history, tenant="b"))
        after = reader.stats()
    finally:
        reader.close()
    # the whole history (~190 tokens) restored, only the new message (~20) prefilled
    assert restored.extra["kv_restored_tokens"] == restored.cached_tokens > restored.prompt_tokens - 30
    assert float(restored.extra["kv_restored_ms"]) > 0  # type: ignore[arg-type]
    assert stats["store_restores"] == 1 and int(stats["prompt_tokens_prefilled"]) < 40  # type: ignore[call-overload]
    assert "kv_restored_tokens" not in intruder.extra and intruder.cached_tokens == 0
    assert after["store_restores"] == 1
    same_answer(warm, cold)  # the intruder's answer is a cold prefill's
    # other settings that shape a sequence's state (fewer cells per sequence): nothing restored
    other = store_engine(tmp_path, n_ctx_per_seq=2048)
    try:
        changed, _ = done_of(other, "turn-2", second_turn(history))
        assert other.stats()["store_restores"] == 0
    finally:
        other.close()
    assert "kv_restored_tokens" not in changed.extra and changed.cached_tokens < 30


def _release(fifo: Path) -> None:
    """Open a FIFO's other end and write what is not an entry: a reader blocked on it goes on."""
    fd = os.open(fifo, os.O_RDWR)  # never blocks, unlike a write-only open with no reader yet
    try:
        os.write(fd, b"not a KV store entry" * 4)
    finally:
        os.close(fd)


@pytest.mark.model
def test_the_steps_go_on_while_the_store_is_read(tmp_path: Path) -> None:
    """A read that does not end (a FIFO in the job's bucket: opening it blocks until someone
    writes) holds up its own job only: the running job keeps generating meanwhile. Then the bad
    file is removed and the job starts cold."""
    engine = store_engine(tmp_path)
    released = threading.Event()
    fifo = engine.store.bucket("b") / ("0" * 32 + SUFFIX)  # type: ignore[union-attr]

    def unblock() -> None:  # a read that hangs the engine's thread ends the test, failed
        released.set()
        _release(fifo)

    watchdog = threading.Timer(120, unblock)
    try:
        engine.admit("running", GenerateRequest(prompt="Count: one, two, three,", max_tokens=60,
                                                temperature=0.0, ignore_eos=True, tenant="a"))
        while "running" not in engine.scheduler.active:
            engine.step(0.01)
        fifo.parent.mkdir(parents=True)
        os.mkfifo(fifo, 0o600)
        watchdog.start()
        engine.admit("reading", GenerateRequest(prompt=FACTS + " Which river flows past Alder4?",
                                                max_tokens=4, temperature=0.0, tenant="b"))
        tokens_meanwhile = 0
        while tokens_meanwhile < 5:
            events = engine.step(0.01)
            if released.is_set():
                break
            assert "reading" not in engine.scheduler.active
            tokens_meanwhile += sum(isinstance(e, Token) and e.job_id == "running" for e in events)
        assert not released.is_set(), "no step ran while the store was read"
        watchdog.cancel()
        _release(fifo)
        done, _ = done_of_started(engine, "reading")
    finally:
        watchdog.cancel()
        engine.close()
    assert done.finish_reason == "length" and done.cached_tokens == 0
    assert engine.stats()["store_removed_bad"] == 1 and not fifo.exists()


@pytest.mark.model
def test_an_idle_engine_starts_jobs_that_arrived_together_once_their_reads_are_done(tmp_path: Path) -> None:
    """A restarted worker's queue arrives at once: a job whose entry is read first waits for the
    others' reads, so their new turns prefill in one step, not its alone first; but a read that
    takes longer than GATHER_READS_SECONDS (a FIFO: it blocks until written) is not waited for."""
    writer = store_engine(tmp_path)
    try:
        history = first_turn(writer)
    finally:
        writer.close()
    engine = store_engine(tmp_path)
    assert engine.store is not None
    fifos = {t: engine.store.bucket(t) / ("0" * 32 + SUFFIX) for t in ("b", "c")}
    for fifo in fifos.values():
        fifo.parent.mkdir(parents=True)
        os.mkfifo(fifo, 0o600)
    watchdog = threading.Timer(120, lambda: [_release(f) for f in fifos.values() if f.exists()])
    watchdog.start()
    try:
        # together: the restored job waits for the slow read, then both start in one step
        engine.admit("restored", second_turn(history))
        engine.admit("slow", GenerateRequest(prompt=FACTS + " Which river flows past Alder4?", max_tokens=4,
                                             temperature=0.0, tenant="b"))
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < GATHER_READS_SECONDS / 2:
            engine.step(0.01)
            assert not engine.scheduler.active, "a job started before the reads of its batch ended"
        _release(fifos["b"])
        while not engine.scheduler.active:
            engine.step(0.01)
        assert set(engine.scheduler.active) == {"restored", "slow"}
        dones: dict[str, Done] = {}
        while len(dones) < 2:
            dones.update((e.job_id, e) for e in engine.step(0.01) if isinstance(e, Done))
        restored = dones["restored"]
        assert restored.extra["kv_restored_tokens"] == restored.cached_tokens > 100
        # a read slower than the bound: the job behind it (a short prompt: nothing to read) starts
        # without it
        engine.admit("stuck", GenerateRequest(prompt=FACTS + " Which river flows past Alder5?", max_tokens=4,
                                              temperature=0.0, tenant="c"))
        t0 = time.perf_counter()
        engine.admit("ready", GenerateRequest(prompt="Count: one, two,", max_tokens=4, temperature=0.0,
                                              tenant="d"))
        assert not next(w for w in engine.scheduler.waiting if w.job_id == "ready").reading  # too short
        while "ready" not in engine.scheduler.active:
            engine.step(0.01)
            assert time.perf_counter() - t0 < 30
        assert time.perf_counter() - t0 >= GATHER_READS_SECONDS and "stuck" not in engine.scheduler.active
        _release(fifos["c"])
        while engine.scheduler.active or engine.scheduler.waiting:
            engine.step(0.01)
    finally:
        watchdog.cancel()
        engine.close()


def done_of_started(engine: LlamaCppBackend, job_id: str) -> tuple[Done, list[Any]]:
    while True:
        for event in engine.step(0.01):
            if isinstance(event, Done) and event.job_id == job_id:
                return event, list(event.extra.get("logprobs", []))  # type: ignore[call-overload]


def _header_of(path: Path) -> Header:
    with path.open("rb") as f:
        header = KvStore(path.parent.parent, IDENTITY, budget_bytes=0)._parse_header(f.read(_PREFIX.size), f)
    assert header is not None
    return header


@pytest.mark.model
def test_an_entry_carries_a_window_checkpoint_only_where_the_window_moved_past_it(tmp_path: Path) -> None:
    """A chat whose sequence still holds the window of its prompt's end: its state serves every
    prefix, and its entry has no checkpoint (the window's size again). One whose answer moved the
    window past its prompt's end keeps the checkpoint taken there: that prefix comes back
    through it (windowed layers keep n_swa + n_batch cells, padded: 768 here)."""
    engine = store_engine(tmp_path)
    long_facts = " ".join(f"Fact {i}: river {i} flows north past the town of Alder{i}." for i in range(35))
    try:
        for job_id, text, tenant, n in (("short", FACTS, "a", 16), ("moved on", long_facts, "b", 320)):
            chat = [Message(role="user", content=text + " Go on.")]
            run(engine, job_id, GenerateRequest(messages=chat, max_tokens=n, temperature=0.0, ignore_eos=True,
                                                tenant=tenant))
        window = engine.model.n_swa
    finally:
        engine.close()
    short, moved = sorted((_header_of(p) for p in files(tmp_path)), key=lambda h: len(h.tokens))
    assert short.checkpoints == [] and short.oldest == 0
    assert not holds_window(moved.oldest, moved.n_prompt, window), "the answer did not move the window on"
    [(at, _)] = moved.checkpoints
    assert at <= moved.n_prompt and not holds_window(moved.oldest, at, window)
