"""The in-process batched llama.cpp engine on the real model: S sequences in one context."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator

import pytest

from backends.base import Done, Event, Failed, JobRejected, Token
from backends.contract.schema import GenerateRequest
from backends.llamacpp import LlamaCppBackend
from backends.llamacpp.invariance import FA_TILE_ROWS
from backends.llamacpp_settings import LlamaCppSettings
from tests import invariant_kernels
from tests.invariant_kernels import verdict_elsewhere

pytestmark = [pytest.mark.model, pytest.mark.timeout(invariant_kernels.SECONDS)]


@pytest.fixture(scope="module")
def _engine() -> Iterator[LlamaCppBackend | None]:
    # batch invariance on explicitly (not the default): the first model of a process fixes ggml's
    # kernels, and the determinism test below needs the invariant ones (tests/invariant_kernels.py).
    # Two threads: a lone row's attention over 512+ cells is split between threads, which batch
    # invariance must undo (docs/ARCHITECTURE.md, "Determinism")
    if not invariant_kernels.here():
        yield None
        return
    b = LlamaCppBackend(LlamaCppSettings(slots=16, n_ctx_per_seq=2048, n_batch=512, prefix_cache=4,
                                        batch_invariant=True), threads=2)
    yield b
    b.close()


@pytest.fixture
def engine(request: pytest.FixtureRequest, _engine: LlamaCppBackend | None) -> object:
    return invariant_kernels.engine_or_verdict(request, _engine)


def run_all(engine: LlamaCppBackend, max_steps: int = 5000) -> tuple[dict[str, str], dict[str, Event]]:
    texts: dict[str, str] = defaultdict(str)
    ends: dict[str, Event] = {}
    for _ in range(max_steps):
        for ev in engine.step(0.0):
            if isinstance(ev, Token):
                texts[ev.job_id] += ev.text
            else:
                ends[ev.job_id] = ev
        if not engine.stats()["active"] and not engine.stats()["waiting"]:
            break
    return dict(texts), ends


def req(prompt: str, n: int = 16, **kw: object) -> GenerateRequest:
    return GenerateRequest(prompt=prompt, max_tokens=n, **kw)  # type: ignore[arg-type]


@verdict_elsewhere
def test_sixteen_jobs_in_flight_complete(engine: LlamaCppBackend) -> None:
    steps0 = engine.stats()["steps"]
    for i in range(16):
        engine.admit(f"j{i}", req(f"Story {i}: the old lighthouse", 24, temperature=0.8, seed=i))
    assert engine.free_slots() == 0 and engine.stats()["active"] == 16
    _texts, ends = run_all(engine)
    assert set(ends) == {f"j{i}" for i in range(16)}
    for i in range(16):
        done = ends[f"j{i}"]
        assert isinstance(done, Done)
        assert done.finish_reason in ("length", "stop")
        if done.finish_reason == "length":
            assert done.completion_tokens == 24
    # batched: 16 x 24 tokens took about 24 steps (one llama_decode each), not 16 x 24
    assert engine.stats()["steps"] - steps0 <= 30
    assert engine.free_slots() == 16 and engine.stats()["kv_reserved"] == 0


TOPICS = ["the old lighthouse", "a recipe for bread", "why the sky is blue", "the history of Rome",
          "how to train a puppy", "a poem about rain", "quantum computers", "the best chess opening",
          "a letter to my future self", "the rules of football", "a day on Mars", "the life of bees",
          "how volcanoes form", "a detective story", "learning the piano", "the water cycle"]


@verdict_elsewhere
def test_greedy_text_is_identical_alone_and_in_a_full_batch(engine: LlamaCppBackend) -> None:
    """With batch_invariant: per-slot KV streams and kernels whose result for a row does not
    depend on the other rows. Prompts of 10 to ~200 tokens (long ones take other
    attention kernels and share their step with decoders); half greedy, half a fixed seed."""
    def request(i: int) -> GenerateRequest:
        prompt = f"Write {'a very long and detailed ' * (i * 5 % 41)}text about {TOPICS[i]}. Begin:"
        if i % 2:
            return req(prompt, 40, temperature=0.8, seed=100 + i)
        return req(prompt, 40, temperature=0.0)

    alone = {}
    for i in range(16):
        engine.admit(f"a{i}", request(i))
        alone.update(run_all(engine)[0])
    lengths = [len(engine.model.prompt_tokens(request(i))) for i in range(16)]
    assert min(lengths) < 16 and max(lengths) > 128, lengths
    for i in range(16):
        engine.admit(f"b{i}", request(i))
    assert engine.stats()["active"] == 16
    batch, _ = run_all(engine)
    different = [i for i in range(16) if alone[f"a{i}"] != batch[f"b{i}"]]
    assert not different, [(alone[f"a{i}"], batch[f"b{i}"]) for i in different]
    assert all(len(alone[f"a{i}"]) > 20 for i in range(16))


@verdict_elsewhere
def test_identical_requests_in_one_batch_get_identical_text(engine: LlamaCppBackend) -> None:
    for i in range(6):
        engine.admit(f"b{i}", req("The recipe begins with", 20, temperature=0.0))
    batch, _ = run_all(engine)
    assert batch["b0"] and all(batch[f"b{i}"] == batch["b0"] for i in range(6))


@verdict_elsewhere
def test_fixed_seed_is_repeatable(engine: LlamaCppBackend) -> None:
    for rnd in range(2):
        for i in range(4):
            engine.admit(f"s{rnd}-{i}", req(f"Seed story {i}:", 16, temperature=0.9, seed=1234 + i))
        if rnd == 0:
            first, _ = run_all(engine)
    second, _ = run_all(engine)
    assert all(first[f"s0-{i}"] == second[f"s1-{i}"] for i in range(4))


@verdict_elsewhere
def test_cancel_frees_slot_for_next_job_at_once(engine: LlamaCppBackend) -> None:
    small = LlamaCppBackend(LlamaCppSettings(slots=2, n_ctx=2048, prefix_cache=0), threads=2)
    try:
        small.admit("x", req("one two three", 200))
        small.admit("y", req("four five six", 200))
        for _ in range(3):
            small.step()
        assert small.free_slots() == 0
        small.cancel("x")
        assert small.free_slots() == 1  # KV cells and slot freed immediately
        small.admit("z", req("seven eight", 4))
        events = small.step()
        assert any(isinstance(e, Done) and e.job_id == "x" and e.finish_reason == "cancelled" for e in events)
        assert small.stats()["active"] == 2  # z is in the batch already
        _texts, ends = run_all(small)
        assert isinstance(ends["z"], Done) and ends["z"].completion_tokens == 4
    finally:
        small.close()


@verdict_elsewhere
def test_long_prompt_prefills_in_chunks_without_stalling_decoders(engine: LlamaCppBackend) -> None:
    for i in range(8):
        engine.admit(f"d{i}", req(f"Decoder {i} says", 20, temperature=0.0))
    for _ in range(3):
        engine.step()  # all 8 are decoding now
    long_prompt = " ".join(f"word{i}" for i in range(390))  # ~1,500 tokens
    reused0 = int(engine.stats()["prompt_tokens_reused"])
    engine.admit("long", req(long_prompt, 4))
    reused = int(engine.stats()["prompt_tokens_reused"]) - reused0  # a slot may keep a few of its tokens
    n_long = len(engine.model.prompt_tokens(req(long_prompt)))
    assert 1400 <= n_long <= 1900 and reused < 64, (n_long, reused)
    per_step: list[tuple[Counter[str], int]] = []  # the decoders' tokens, and draft tokens kept
    prefilled0 = engine.stats()["prompt_tokens_prefilled"]
    while engine.stats()["prompt_tokens_prefilled"] - prefilled0 < n_long - reused:
        kept0 = engine.scheduler.draft_accepted
        events = engine.step()
        tokens: Counter[str] = Counter()
        for e in events:
            if isinstance(e, Token) and e.job_id.startswith("d"):
                tokens[e.job_id] += e.n_tokens
        per_step.append((tokens, engine.scheduler.draft_accepted - kept0))
    # every step of the prefill carried a token for each of the 8 decoders: no stall; and nothing
    # more than that but the draft tokens kept (whether a decoder drafts beside a chunk weighs
    # StepCosts, timed on this CPU: so the drafts are counted, not assumed absent)
    decoders = {f"d{i}" for i in range(8)}
    assert per_step and all(set(tokens) == decoders and min(tokens.values()) >= 1
                            and tokens.total() == 8 + kept for tokens, kept in per_step), per_step
    # batch-invariant: chunks cut at multiples of n_batch whatever the load (else n_batch minus
    # the decoders)
    assert len(per_step) == -(-n_long // engine.n_batch) - reused // engine.n_batch
    run_all(engine)


@verdict_elsewhere
def test_shared_prefix_is_copied_not_prefilled(engine: LlamaCppBackend) -> None:
    system = "You are a helpful assistant who answers in one short sentence. " * 20
    engine.admit("p0", req(system + "Question: what is Redis?", 4, temperature=0.0))
    engine.step()
    before = engine.stats()
    for i in range(1, 5):
        engine.admit(f"p{i}", req(system + f"Question: what is {i}?", 4, temperature=0.0))
    after = engine.stats()
    n_prefix = len(engine.model.prompt_tokens(req(system)))
    reused = int(after["prompt_tokens_reused"]) - int(before["prompt_tokens_reused"])
    # batch-invariant: the last FA_TILE_ROWS prompt tokens are prefilled again, so they meet the
    # same attention kernel as alone (see backends/llamacpp/invariance.py)
    assert reused >= 4 * (n_prefix - FA_TILE_ROWS), (reused, n_prefix)
    _texts, ends = run_all(engine)
    assert all(isinstance(ends[f"p{i}"], Done) for i in range(5))
    assert engine.stats()["prefixes"] >= 1  # kept for the next job with this system prompt


def test_shared_prefix_in_one_kv_pool() -> None:
    """kv_unified: one KV pool, where a prefix copy only tags cells."""
    pool = LlamaCppBackend(LlamaCppSettings(slots=4, n_ctx=2048, prefix_cache=2, kv_unified=True),
                           threads=2)
    try:
        system = "You are a terse assistant. Answer with one word only, please. " * 4
        for i in range(3):
            pool.admit(f"q{i}", req(system + f"Question {i}: colour of the sky?", 6, temperature=0.0))
            pool.step()  # q0 prefilled: the next ones copy its prefix
        _texts, ends = run_all(pool)
        assert all(isinstance(ends[f"q{i}"], Done) for i in range(3))
        assert int(pool.stats()["prompt_tokens_reused"]) >= 2 * 40
        assert pool.stats()["kv_reserved"] == 0
    finally:
        pool.close()


def test_a_pool_slot_takes_a_copied_prefix_cleanly_after_other_jobs() -> None:
    """In the pool a copy only tags the source's cells: a newcomer whose slot still held
    another job's cells would get two cells per position and fail the whole decode (rc -1, seen
    when the pool kept finished jobs' KV). Slots are reused here, then a newcomer copies a
    running job's prefix."""
    pool = LlamaCppBackend(LlamaCppSettings(slots=4, prefix_cache=2, kv_unified=True), threads=2)
    try:
        story = "Once upon a time a fisherman lived by the sea with his wife and three sons. " * 8
        pool.admit("x", req("Fruit. " + story, 4, temperature=0.0))
        pool.admit("y", req("City. " + story, 4, temperature=0.0))
        run_all(pool)  # slots 0 and 1 held x's and y's cells, longer than the prefix d will copy
        system = "You are a terse assistant. Answer with one word only, please. " * 4
        pool.admit("c", req(system + "Question: colour of the sky?", 8, temperature=0.0))
        pool.step()  # c (slot 0) prefilled; d gets slot 1 and copies c's prefix
        pool.admit("d", req(system + "Question: colour of grass?", 8, temperature=0.0))
        _texts, ends = run_all(pool)
        assert isinstance(ends["c"], Done) and isinstance(ends["d"], Done), ends
        assert int(pool.stats()["prompt_tokens_reused"]) >= 40
    finally:
        pool.close()


@verdict_elsewhere
def test_next_turn_reuses_the_slot_kv_and_keeps_the_text(engine: LlamaCppBackend) -> None:
    """A finished job's KV stays in its slot: the next turn of the chat (prompt + answer + more)
    prefills only what is new, and its text is the one a fresh engine gives."""
    first = "User: name three colours.\nAssistant:"
    engine.admit("turn1", req(first, 12, temperature=0.0))
    answer, _ = run_all(engine)
    follow = first + answer["turn1"] + "\nUser: and three animals?\nAssistant:"
    assert len(engine.model.prompt_tokens(req(follow))) < FA_TILE_ROWS  # row-by-row on both sides
    reused0 = int(engine.stats()["prompt_tokens_reused"])
    engine.admit("turn2", req(follow, 12, temperature=0.0))
    texts, _ = run_all(engine)
    n_first = len(engine.model.prompt_tokens(req(first)))
    assert int(engine.stats()["prompt_tokens_reused"]) - reused0 >= n_first - 1
    fresh = LlamaCppBackend(
        LlamaCppSettings(slots=2, n_ctx_per_seq=512, prefix_cache=0, batch_invariant=True), threads=2)
    try:
        fresh.admit("turn2", req(follow, 12, temperature=0.0))
        baseline, _ = run_all(fresh)
        assert fresh.stats()["prompt_tokens_reused"] == 0
    finally:
        fresh.close()
    assert texts["turn2"] == baseline["turn2"] and texts["turn2"]


@verdict_elsewhere
def test_a_burst_on_a_new_system_prompt_prefills_it_once(engine: LlamaCppBackend) -> None:
    system = "You are the help desk of a small library; answer politely and briefly. " * 25
    asks = [f"Question {i}: when do you open on day {i}?" for i in range(5)]
    before = engine.stats()
    for i, ask in enumerate(asks):  # all at once: none of them finds the system prompt anywhere
        engine.admit(f"burst{i}", req(system + ask, 8, temperature=0.0))
    burst, _ = run_all(engine)
    prefilled = int(engine.stats()["prompt_tokens_prefilled"]) - int(before["prompt_tokens_prefilled"])
    n_prefix = len(engine.model.prompt_tokens(req(system)))
    per_ask = max(len(engine.model.prompt_tokens(req(system + a))) for a in asks) - n_prefix
    # the system prompt once, then each question (and the FA_TILE_ROWS tokens batch invariance
    # prefills again); five times the system prompt without waiting for it
    assert prefilled <= n_prefix + 5 * (per_ask + FA_TILE_ROWS), (prefilled, n_prefix)
    for i, ask in enumerate(asks):  # and the copied KV gives each the text it gets alone
        engine.admit(f"alone{i}", req(system + ask, 8, temperature=0.0))
        alone, _ = run_all(engine)
        assert alone[f"alone{i}"] == burst[f"burst{i}"]


@verdict_elsewhere
def test_prefix_reuse_gives_the_same_greedy_text(engine: LlamaCppBackend) -> None:
    system = "The following is a conversation about the weather in spring. " * 5
    engine.admit("first", req(system + "It was sunny and", 12, temperature=0.0))
    a, _ = run_all(engine)
    engine.admit("second", req(system + "It was sunny and", 12, temperature=0.0))
    b, _ = run_all(engine)
    assert a["first"] == b["second"]


@verdict_elsewhere
def test_prompt_longer_than_context_is_rejected_clearly(engine: LlamaCppBackend) -> None:
    huge = " ".join(f"w{i}" for i in range(3000))
    with pytest.raises(JobRejected, match=r"prompt is \d+ tokens; the context holds 2048 per job"):
        engine.admit("huge", req(huge, 8))
    assert engine.free_slots() == 16


def test_kv_exhaustion_defers_admission_not_running_jobs() -> None:
    tiny = LlamaCppBackend(LlamaCppSettings(slots=4, n_ctx=256, n_ctx_per_seq=128, prefix_cache=0,
                                           kv_unified=True), threads=2)
    try:
        for i in range(4):  # each reserves prompt + 60 cells of 256: only 3 fit at once
            tiny.admit(f"k{i}", req(f"Count from {i}:", 60))
        assert tiny.stats()["active"] == 3 and tiny.stats()["waiting"] == 1
        _texts, ends = run_all(tiny)
        assert all(isinstance(ends[f"k{i}"], Done) for i in range(4))
        assert not any(isinstance(e, Failed) for e in ends.values())
        assert int(tiny.stats()["deferred_admissions"]) > 0
    finally:
        tiny.close()


@verdict_elsewhere
def test_utf8_split_across_tokens_never_reaches_stream_broken(engine: LlamaCppBackend) -> None:
    engine.admit("u", req("Écris une phrase en japonais: 日本語の文章は", 40, temperature=0.0))
    deltas: list[str] = []
    for _ in range(100):
        for ev in engine.step():
            if isinstance(ev, Token):
                deltas.append(ev.text)
        if not engine.stats()["active"]:
            break
    assert deltas and all("\ufffd" not in d for d in deltas)
