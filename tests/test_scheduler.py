"""The engine's scheduling policy without a model: admission, chunked prefill, batch rows."""

from __future__ import annotations

import statistics
import subprocess
import sys

import pytest

from backends.base import Done, Failed, JobRejected, Token
from backends.contract.schema import GenerateRequest, SamplingDefaults
from backends.llamacpp.kv import KvBookkeeper, Remove
from backends.llamacpp.scheduler import DecodeCall, Scheduler
from backends.llamacpp.state import ActiveJob, Sampled
from tests.engine_state import admit, engine, execute, prompt, rows_of, sampled_sevens


def test_the_policy_modules_do_not_import_llama_cpp() -> None:
    code = ("import sys, backends.llamacpp.scheduler, backends.llamacpp.kv; "
            "sys.exit('llama_cpp' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_admission_waits_for_a_free_slot() -> None:
    s = engine(slots=2, prefix_cache=0)
    assert [j.seq_id for j in admit(s, "a", prompt(10)) + admit(s, "b", prompt(10, 5000))] == [0, 1]
    assert s.free_slots() == 0
    with pytest.raises(RuntimeError, match="no free slot"):
        s.enqueue("c", prompt(10), s.active["a"].sampling)
    s.release(s.active["a"])
    assert s.free_slots() == 1
    assert [j.seq_id for j in admit(s, "c", prompt(10, 9000))] == [0]


def test_a_prompt_longer_than_the_context_is_rejected() -> None:
    s = engine(n_ctx_per_seq=512)
    with pytest.raises(JobRejected, match=r"prompt is 512 tokens; the context holds 512 per job"):
        admit(s, "huge", prompt(512))
    assert s.free_slots() == 16 and not s.waiting


def test_unified_pool_defers_admission_in_line_and_never_preempts() -> None:
    s = engine(slots=5, prefix_cache=0, n_ctx=256, n_ctx_per_seq=128, per_slot=False)
    for i in range(4):  # each reserves 5 + 60 cells of 256: only 3 fit at once
        admit(s, f"k{i}", prompt(5, 100 * i), max_tokens=60)
    assert len(s.active) == 3 and [w.job_id for w in s.waiting] == ["k3"]
    assert s.kv.reserved == 195 and s.deferred_admissions == 1
    admit(s, "small", prompt(1, 900), max_tokens=5)  # would fit, but waits behind k3
    assert [w.job_id for w in s.waiting] == ["k3", "small"]
    s.release(s.active["k0"])
    assert [j.job_id for j in s.start_waiting()] == ["k3", "small"]
    assert s.kv.reserved == 3 * 65 + 6 and not s.waiting


def test_per_slot_streams_admit_whenever_a_slot_is_free() -> None:
    s = engine(slots=4, prefix_cache=0, n_ctx=256, n_ctx_per_seq=4096, per_slot=True)
    for i in range(4):  # a slot's stream is its budget: the pool size plays no part
        admit(s, f"k{i}", prompt(1000, 5000 * i), max_tokens=1000)
    assert len(s.active) == 4 and s.deferred_admissions == 0


@pytest.mark.parametrize("invariant", [True, False])
def test_a_long_prompt_prefills_in_chunks_while_every_decoder_keeps_its_row(invariant: bool) -> None:
    s = engine(per_slot=invariant)
    for i in range(8):
        admit(s, f"d{i}", prompt(10, 100 * i), max_tokens=1000)
    while any(j.next_token is None for j in s.active.values()):
        execute(s, s.plan_step())
    (long,) = admit(s, "long", prompt(3000, 50_000))
    decoders = {j.seq_id for j in s.active.values() if j is not long}
    chunks: list[int] = []
    while long.next_token is None:
        plan = s.plan_step()
        fed = [rows_of(c) for c in plan.calls]
        # every decoder has exactly one row in every step of the prefill: no stall
        assert sorted(i for rows in fed for i in rows if i in decoders) == sorted(decoders)
        assert all(rows[i] == 1 for rows in fed for i in rows if i in decoders)
        assert all(c.n_rows() <= s.n_batch for c in plan.calls)
        chunks += [rows[long.seq_id] for rows in fed if long.seq_id in rows]
        execute(s, plan)
    assert sum(chunks) == 3000
    if invariant:  # cut at multiples of n_batch whatever the load, each in a llama_decode of its own
        assert chunks == [512] * 5 + [440]
    else:  # one llama_decode per step: the budget left after the 8 decoders' rows
        assert chunks == [504] * 5 + [480]


def test_newcomers_go_first_and_the_decoders_are_never_skipped_twice() -> None:
    s = engine()
    for i in range(4):
        admit(s, f"d{i}", prompt(10, 100 * i), max_tokens=1000)
    execute(s, s.plan_step())  # the four short prompts share one equal-width ubatch
    decoders = {f"d{i}" for i in range(4)}
    skipped_before = False
    for n in range(6):  # a short prompt arrives before every step
        admit(s, f"new{n}", prompt(10, 10_000 + 100 * n), max_tokens=1000)
        plan = s.plan_step()
        ran = {j.job_id for c in plan.calls for j in c.decoders}
        skipped = not decoders <= ran
        assert not (skipped and skipped_before), n
        assert any(j.job_id == f"new{n}" for c in plan.calls for j, _ in c.prompts)
        skipped_before = skipped
        execute(s, plan)
        decoders.add(f"new{n}")


def test_newcomers_steps_run_back_to_back_only_while_they_cost_less_than_the_decoders_call() -> None:
    s = engine()
    for i in range(4):
        admit(s, f"d{i}", prompt(10, 100 * i), max_tokens=1000)
    execute(s, s.plan_step())
    execute(s, s.plan_step(), seconds=0.060)  # the decoders' call: 60 ms
    skipped = []
    for n in range(5):  # newcomers arrive before every step; each of their calls takes 25 ms
        admit(s, f"new{n}", prompt(10, 10_000 + 100 * n), max_tokens=1000)
        plan = s.plan_step()
        skipped.append(not any(c.decoders for c in plan.calls))
        execute(s, plan, seconds=0.025)
    # 0 ms, 25, 50 of newcomers' steps are under 60: three in a row; at 75 the decoders run
    assert skipped == [True, True, True, False, True]


def test_a_returning_conversations_last_chunk_goes_before_the_decoders() -> None:
    s = engine()
    for i in range(4):
        admit(s, f"d{i}", prompt(10, 100 * i), max_tokens=1000)
    execute(s, s.plan_step())
    (back,) = admit(s, "back", prompt(1000, 50_000))
    back.n_past = 960  # its history found in the KV: 40 new tokens left
    plan = s.plan_step()
    assert not any(c.decoders for c in plan.calls)
    assert [rows_of(c) for c in plan.calls] == [{back.seq_id: 40}]
    execute(s, plan)
    assert back.next_token is not None  # its first token came out of that step
    execute(s, s.plan_step())  # the decoders' turn (back among them)
    (fresh,) = admit(s, "fresh", prompt(300, 70_000))  # a new prompt of one chunk: first too
    plan = s.plan_step()
    assert [rows_of(c) for c in plan.calls] == [{fresh.seq_id: 300}]
    execute(s, plan)
    execute(s, s.plan_step())
    admit(s, "long", prompt(1000, 90_000))  # a prompt of two chunks prefills beside the decoders
    for _ in range(2):
        plan = s.plan_step()
        assert any(c.decoders for c in plan.calls)
        execute(s, plan)


def test_decoders_share_one_equal_width_ubatch_over_consecutive_ids() -> None:
    s = engine(slots=4, prefix_cache=0)
    for i in range(3):
        admit(s, f"d{i}", prompt(10, 100 * i), max_tokens=1000)
    execute(s, s.plan_step())
    s.release(s.active["d1"])
    (call,) = s.plan_step().calls
    assert call.span == (0, 2) and call.width == 1 and call.n_rows() == 3  # id 1 gets a throw-away row


# The neighbour row is batch invariance's promise (the lone row's text as the batched kernel's);
# by default a lone decoder decodes alone, as in llama-server, and saves the row's cost.
@pytest.mark.parametrize(("slots", "lone_id", "invariant", "span"),
                         [(2, 0, True, (0, 1)), (2, 1, True, (0, 1)),
                          (2, 0, False, (0, 0)), (2, 1, False, (1, 1))])
def test_a_lone_long_decoder_gets_a_neighbour_row_only_with_batch_invariance(
        slots: int, lone_id: int, invariant: bool, span: tuple[int, int]) -> None:
    s = engine(slots=slots, prefix_cache=0, invariant=invariant)
    for i in range(slots):
        admit(s, f"d{i}", prompt(10, 100 * i), max_tokens=1000)
    execute(s, s.plan_step())
    s.release(s.active[f"d{1 - lone_id}"])
    lone = s.active[f"d{lone_id}"]
    assert s.plan_step().calls[0].span == (lone_id, lone_id)  # 11 cells: its KV scan is not split
    lone.n_past = 300
    assert s.plan_step().calls[0].span == span


def test_short_prompts_share_a_ubatch_while_it_fits_the_rest_run_alone() -> None:
    s = engine(slots=4, prefix_cache=0, n_batch=128)
    for i in range(4):
        admit(s, f"p{i}", prompt(40, 100 * i))
    shared, alone = s.plan_step().calls
    assert [j.job_id for j, _ in shared.prompts] == ["p0", "p1", "p2"]
    assert shared.span == (0, 2) and shared.width == 40  # 3 x 40 rows; a 4th id would be 160
    assert [(j.job_id, n) for j, n in alone.prompts] == [("p3", 40)] and alone.span is None


@pytest.mark.parametrize(("width", "spans"), [(4, [(0, 6)]), (30, [(0, 0), (2, 2), (4, 4), (6, 6)])])
def test_short_prompts_between_busy_slots_split_where_padding_costs_more_than_a_call(
        width: int, spans: list[tuple[int, int]]) -> None:
    s = engine(slots=8, prefix_cache=0)
    for i in range(8):
        admit(s, f"d{i}", prompt(10, 100 * i), max_tokens=1000)
    execute(s, s.plan_step())
    execute(s, s.plan_step())
    for i in range(0, 8, 2):  # newcomers land in the even slots, decoders hold the odd ones
        s.release(s.active[f"d{i}"])
        admit(s, f"new{i}", prompt(width, 10_000 + 100 * i))
    calls = s.plan_step().calls  # newcomers first: no decoder in this step
    assert not any(c.decoders for c in calls)
    assert [c.span for c in calls] == spans
    # one padded span of 7 ids x 30 rows (210) costs more than 4 calls of 30 (120 + 3 calls)
    assert sum(c.n_rows() for c in calls) == (7 * 4 if width == 4 else 4 * 30)


def test_newcomers_sharing_a_prefix_being_prefilled_wait_for_it_then_prefill_only_their_own() -> None:
    s = engine(slots=4, prefix_cache=2)
    preamble = prompt(300, 5000)
    first, *rest = (preamble + prompt(30, 100_000 + 100 * i) for i in range(3))
    admit(s, "a", first)
    for i, tokens in enumerate(rest):
        assert admit(s, f"b{i}", tokens) == []  # a burst: all arrive while "a" has prefilled nothing
    assert admit(s, "other", prompt(300, 60_000)) == [s.active["other"]]  # no shared prefix: not held
    assert s.free_slots() == 0  # the held ones keep their slots (the worker claims no more)
    plan = s.plan_step()
    assert {j.job_id for c in plan.calls for j, _ in c.prompts} == {"a", "other"}
    execute(s, plan)
    started = s.start_waiting()  # "a" holds the preamble now
    assert [j.job_id for j in started] == ["b0", "b1"]
    assert [j.n_past for j in started] == [300, 300]  # only their own 30 tokens left
    assert [rows_of(c) for c in s.plan_step().calls] == [{j.seq_id: 30 for j in started}]


def test_a_held_newcomer_starts_at_once_when_the_job_it_waits_for_goes() -> None:
    s = engine(slots=2, prefix_cache=0)
    preamble = prompt(200, 5000)
    admit(s, "a", preamble + prompt(10, 100_000))
    assert admit(s, "b", preamble + prompt(10, 200_000)) == []
    s.release(s.active["a"], keep_kv=False)  # cancelled before its prompt was in
    (b,) = s.start_waiting()
    assert b.job_id == "b" and b.n_past == 0


def test_in_the_unified_pool_a_held_newcomer_keeps_its_cells() -> None:
    s = engine(slots=4, prefix_cache=0, per_slot=False, n_ctx=900, n_ctx_per_seq=900)
    preamble = prompt(300, 5000)
    admit(s, "a", preamble + prompt(10, 100_000))  # 326 cells (prompt + 16 out)
    assert admit(s, "w", preamble + prompt(10, 200_000)) == []  # held: 326 cells are its
    assert admit(s, "x", prompt(300, 300_000)) == []  # 316 more would leave w too few
    execute(s, s.plan_step())
    assert [j.job_id for j in s.start_waiting()] == ["w"]  # in line before x
    assert [j.job_id for j in s.waiting] == ["x"]


def test_with_batch_invariance_a_newcomer_waits_only_for_what_it_may_reuse() -> None:
    kv = KvBookkeeper(slots=4, prefix_cache=2, n_ctx=16384, n_batch=512, per_slot=True, invariant=True)
    s = Scheduler(kv, n_batch=512, n_ctx_per_seq=4096)
    admit(s, "a", prompt(100, 5000) + prompt(10, 100_000))
    # 100 shared tokens, but invariance reuses only what leaves the kernel its prompt meets alone
    (b,) = admit(s, "b", prompt(100, 5000) + prompt(10, 200_000))
    assert b.job_id == "b"


@pytest.mark.parametrize(("shared", "held"), [(40, False), (550, False), (900, True)])
def test_a_newcomer_waits_only_for_a_long_prefix_it_cannot_reuse_yet(shared: int, held: bool) -> None:
    s = engine(slots=4, prefix_cache=2)
    admit(s, "a", prompt(shared, 5000) + prompt(1000 - shared, 100_000))
    early = admit(s, "early", prompt(shared, 5000) + prompt(50, 200_000))
    assert [j.job_id for j in early] == ([] if shared >= 64 else ["early"])
    execute(s, s.plan_step())  # "a" prefilled its first chunk: 512 tokens
    started = admit(s, "b", prompt(shared, 5000) + prompt(50, 300_000))
    if not held:  # 40: too short to wait for; 550: 512 of it are there, 38 more are not worth a step
        assert [(j.job_id, j.n_past) for j in started if j.job_id == "b"] == [("b", min(shared, 512))]
        return
    assert started == []
    execute(s, s.plan_step())  # "a" prefilled the rest
    assert [(j.job_id, j.n_past) for j in s.start_waiting()] == [("early", 900), ("b", 900)]


def test_short_prompts_split_where_a_padded_stream_has_no_cells_for_the_width() -> None:
    s = engine(slots=3, prefix_cache=0, n_ctx_per_seq=64)
    for i in range(3):
        admit(s, f"d{i}", prompt(10, 100 * i), max_tokens=1000)
    execute(s, s.plan_step())
    s.active["d1"].n_past = 61  # 3 cells left in stream 1
    for i in (0, 2):
        s.release(s.active[f"d{i}"], keep_kv=False)
        admit(s, f"new{i}", prompt(4, 10_000 + 100 * i))
    # one span over ids 0..2 (4 rows each) would write 4 rows into stream 1: two calls instead
    assert [c.span for c in s.plan_step().calls] == [(0, 0), (2, 2)]


def test_unified_pool_fills_one_call_up_to_n_batch_in_admission_order() -> None:
    s = engine(n_batch=256, per_slot=False)
    admit(s, "a", prompt(200, 0))
    admit(s, "b", prompt(200, 1000))
    plan = s.plan_step()
    assert [(j.job_id, n) for j, n in plan.calls[0].prompts] == [("a", 200), ("b", 56)]
    execute(s, plan)
    (call,) = s.plan_step().calls  # a decodes now, b's rest fits beside it
    assert [j.job_id for j in call.decoders] == ["a"]
    assert [(j.job_id, n) for j, n in call.prompts] == [("b", 144)]


def test_which_jobs_fail_with_a_call() -> None:
    s = engine(per_slot=False)
    a, b, c = (admit(s, x, prompt(10, 100 * i))[0] for i, x in enumerate("abc"))
    pooled = DecodeCall(decoders=[a], prompts=[(b, 10), (c, 10)])
    assert s.failed(pooled, 1) == [c]  # KV full: the newest prompt, the decoders keep going
    assert s.failed(pooled, -1) == [a, b, c]
    shared = DecodeCall(prompts=[(b, 10), (c, 10)], span=(1, 2), width=10)
    assert s.failed(shared, 1) == [b, c]  # one ubatch stands or falls together


# -- what sampled tokens do to a job (Scheduler.update, updates.py) ----------------------------------


def rows(job: ActiveJob, *got: tuple[int, bytes | None]) -> Sampled:
    return Sampled({job.seq_id: list(got)})


def decoding(stop: list[str] | None = None, max_tokens: int = 16,
             n_ctx_per_seq: int = 4096) -> tuple[Scheduler, ActiveJob]:
    """A job whose prompt just ran: it has sampled token 1 ("a") and decodes next."""
    s = engine(n_ctx_per_seq=n_ctx_per_seq)
    req = GenerateRequest(prompt="-", max_tokens=max_tokens, temperature=0.0, stop=stop or [])
    s.enqueue("j", prompt(10), req.sampling(SamplingDefaults()))
    (job,) = s.start_waiting()
    (call,) = s.plan_step().calls
    s.update(call, rows(job, (1, b"a")))
    assert job.next_token == 1 and job.n_past == 10
    return s, job


def test_a_decoder_keeps_draft_tokens_while_each_is_what_was_sampled_before_it() -> None:
    s, job = decoding()
    call = DecodeCall(decoders=[job], drafts={job.seq_id: [2, 3, 4]})
    out = s.update(call, rows(job, (2, b"b"), (3, b"c"), (9, b"i")))
    assert job.output == [1, 2, 3, 9] and job.next_token == 9 and job.n_past == 13
    assert [ev.text for ev in out.events if isinstance(ev, Token)] == ["b", "c", "i"]
    assert out.kv_ops == [Remove(job.seq_id, 13)]  # the row of the draft token not kept
    assert (s.draft_tokens, s.draft_accepted, s.tokens_generated) == (3, 2, 4)
    call = DecodeCall(decoders=[job], drafts={job.seq_id: [5]})
    out = s.update(call, rows(job, (5, b"e"), (6, b"f")))
    assert job.n_past == 15 and out.kv_ops == [] and not out.finished  # all kept: nothing to drop


def test_a_job_ends_at_the_end_of_generation_a_stop_string_or_its_length() -> None:
    s, job = decoding()
    out = s.update(DecodeCall(decoders=[job]), rows(job, (0, None)))
    assert out.finished == [job] and job.done == Done("j", "stop", 10, 1) and job.output == [1]
    assert s.end_step() == [job] and not s.active

    s, job = decoding(stop=["c."])
    call = DecodeCall(decoders=[job], drafts={job.seq_id: [2, 3, 4]})
    out = s.update(call, rows(job, (2, b"b"), (3, b"c"), (4, b"."), (5, b"d")))
    assert job.done == Done("j", "stop", 10, 4, extra={"stop_word": "c."}) and job.output == [1, 2, 3, 4]
    assert "".join(ev.text for ev in out.events if isinstance(ev, Token)) == "b"  # "a" went before
    assert s.draft_accepted == 2 and out.kv_ops == [Remove(job.seq_id, 13)]

    s, job = decoding(max_tokens=2)
    out = s.update(DecodeCall(decoders=[job]), rows(job, (2, b"b")))
    assert job.done == Done("j", "length", 10, 2)

    s, job = decoding(n_ctx_per_seq=13)  # the context's last cell: position 12
    for tok in (2, 3):
        s.update(DecodeCall(decoders=[job]), rows(job, (tok, b"x")))
    assert job.done == Done("j", "length", 10, 3) and job.n_past == 12


def test_a_held_stop_string_prefix_is_flushed_when_the_job_ends_otherwise() -> None:
    s, job = decoding(stop=["xyz"], max_tokens=3)
    out = s.update(DecodeCall(decoders=[job]), rows(job, (2, b"x")))
    assert not [ev for ev in out.events if isinstance(ev, Token)]  # "x" may start the stop string
    out = s.update(DecodeCall(decoders=[job]), rows(job, (3, b"y")))
    assert [(ev.text, ev.n_tokens) for ev in out.events if isinstance(ev, Token)] == [("xy", 0)]
    assert job.done == Done("j", "length", 10, 3)


def test_a_rejected_job_and_a_failed_call_free_their_slots_at_once() -> None:
    s, job = decoding()
    out = s.update(DecodeCall(decoders=[job]), Sampled(rejected={job.seq_id: "no way on"}))
    assert out.events == [Failed("j", "no way on")] and out.released == [job.seq_id]
    assert out.kv_ops == [Remove(job.seq_id)] and not s.active and job.done is None
    s, job = decoding()
    out = s.call_failed(DecodeCall(decoders=[job]), 1)
    assert out.events == [Failed("j", "KV cache full; job not completed", retryable=True)]
    assert out.released == [job.seq_id] and out.kv_ops == [Remove(job.seq_id)] and not s.active


def simulated_seconds(call: DecodeCall) -> float:
    """A CPU's costs: a call 10 ms, a decoder's row 8 ms, a prompt row 0.8 ms plus 0.2 us per cell
    it attends over (the shape pacing.py fits)."""
    prompt_rows = sum(0.0008 + 2e-7 * (job.n_past + count / 2) for job, count in call.prompts
                      for _ in range(count))
    return 0.010 + 0.008 * len(call.decoders) + prompt_rows


def streaming(target_ms: float) -> Scheduler:
    """Four jobs streaming, a stall target of `target_ms`."""
    kv = KvBookkeeper(slots=8, prefix_cache=0, n_ctx=8 * 4096, n_batch=512, per_slot=True, invariant=False)
    s = Scheduler(kv, n_batch=512, n_ctx_per_seq=4096, max_stall_ms=target_ms)
    for i in range(4):
        admit(s, f"d{i}", prompt(10, 100 * i), max_tokens=1000)
    while any(j.next_token is None for j in s.active.values()):
        execute(s, s.plan_step())
    return s


def prefill_beside_streams(s: Scheduler, prompts: list[ActiveJob]) -> tuple[list[float], list[int]]:
    """Steps until `prompts` are prefilled, on simulated costs: each stream's wait (from one
    decoders' call to the end of the next, the last one open) and the prompts' chunks."""
    gaps: list[float] = []
    chunks: list[int] = []
    waited = 0.0
    while any(j.next_token is None for j in prompts):
        for call in s.plan_step().calls:
            chunks += [count for job, count in call.prompts if job in prompts]
            waited += (seconds := simulated_seconds(call))
            s.update(call, sampled_sevens(call), seconds)
            if call.decoders:
                gaps.append(waited)
                waited = 0.0
        s.end_step()
    return [*gaps, waited], chunks


@pytest.mark.parametrize("target_ms", [150, 250])
def test_a_long_prompt_beside_streams_takes_what_fits_the_stall_target(target_ms: int) -> None:
    s = streaming(target_ms)
    longs = [admit(s, f"long{i}", prompt(3000, 50_000 * (i + 1)))[0] for i in range(2)]
    gaps, chunks = prefill_beside_streams(s, longs)
    gaps = gaps[:-1]  # closed waits only
    assert sum(chunks) == 6000
    timed = gaps[3:]  # the first steps take 32 rows: they time the machine
    assert max(timed) <= target_ms / 1000, max(timed)
    # and a step uses most of what it may: the prefill is not starved
    assert statistics.median(timed) >= 0.7 * target_ms / 1000, statistics.median(timed)


@pytest.mark.parametrize("size", [300, 400, 500])
def test_a_newcomer_whose_own_step_would_pass_the_stall_target_is_paced(size: int) -> None:
    """A newcomer's whole prompt in a step of its own goes out sooner, but the streams skip that
    step: where it would hold them past the target (a first turn of a few hundred tokens is
    seconds of prefill on a CPU), it is paced beside them like a long prompt."""
    s = streaming(250)
    (timer,) = admit(s, "timer", prompt(3000, 50_000))  # times this machine's rows
    prefill_beside_streams(s, [timer])
    (newcomer,) = admit(s, "newcomer", prompt(size, 90_000))
    assert simulated_seconds(DecodeCall(prompts=[(newcomer, size)])) > 0.25  # alone, past the target
    gaps, chunks = prefill_beside_streams(s, [newcomer])
    assert sum(chunks) == size and len(chunks) > 1
    assert max(gaps) <= 0.25, gaps
    # one that fits still takes its own step: its first token goes out sooner
    (short,) = admit(s, "short", prompt(100, 120_000))
    gaps, chunks = prefill_beside_streams(s, [short])
    assert chunks == [100] and max(gaps) <= 0.25, gaps


def test_without_streams_a_long_prompt_takes_whole_chunks_and_zero_turns_pacing_off() -> None:
    for target, alone in ((200, True), (0, False)):
        kv = KvBookkeeper(slots=4, prefix_cache=0, n_ctx=4 * 4096, n_batch=512, per_slot=True,
                          invariant=False)
        s = Scheduler(kv, n_batch=512, n_ctx_per_seq=4096, max_stall_ms=target)
        if not alone:
            admit(s, "d", prompt(10), max_tokens=1000)
            execute(s, s.plan_step())
        (long,) = admit(s, "long", prompt(3000, 50_000))
        chunks = []
        while long.next_token is None:
            plan = s.plan_step()
            chunks += [count for c in plan.calls for job, count in c.prompts if job is long]
            execute(s, plan, seconds=0.5)  # slow calls: pacing, were it on, would cut them
        assert chunks == [512] * 5 + [440]


def second_prompt_ttft(max_stall_ms: float, slowdown: float, n_batch: int = 1024) -> float:
    """Beside 16 decoders (a 138 ms call of their own), a 3,000-token prompt's time to its first
    token at simulated_seconds' costs: every call of every step from its arrival (the streams'
    too). The prompt before it times the machine (a fit's first steps take MIN_ROWS rows)."""
    kv = KvBookkeeper(slots=20, prefix_cache=0, n_ctx=20 * 4096, n_batch=n_batch, per_slot=True,
                      invariant=False)
    s = Scheduler(kv, n_batch=n_batch, n_ctx_per_seq=4096, max_stall_ms=max_stall_ms,
                  max_prefill_slowdown=slowdown)
    for i in range(16):
        admit(s, f"d{i}", prompt(10, 100 * i), max_tokens=4000)
    while any(j.next_token is None for j in s.active.values()):
        execute(s, s.plan_step())
    waited = 0.0
    for i in range(2):
        (long,) = admit(s, f"long{i}", prompt(3000, 50_000 * (i + 1)))
        waited = 0.0
        while long.next_token is None:
            for call in s.plan_step().calls:
                waited += (seconds := simulated_seconds(call))
                s.update(call, sampled_sevens(call), seconds)
            s.end_step()
    return waited


@pytest.mark.parametrize("slowdown", [0.5, 0.25])
def test_a_prompt_beside_streams_that_fill_the_target_is_slowed_by_at_most_max_prefill_slowdown(
        slowdown: float) -> None:
    """The streams' own call (138 ms) nearly fills the 150 ms target, so the prompt keeps rows
    worth its share of each step: its TTFT is at most 1 + slowdown times that of whole n_batch
    chunks beside the same streams (max_stall_ms 0), and the streams still run more often than
    between whole chunks. (n_batch 1,024: a share is capped at n_batch rows, as whole chunks are,
    and a smaller cap would cut the share.)"""
    paced, whole = second_prompt_ttft(150, slowdown), second_prompt_ttft(0, slowdown)
    assert 1.0 < paced / whole <= 1 + slowdown, (paced, whole)


def test_decoders_do_not_draft_beside_a_paced_prompt_and_draft_again_after_it() -> None:
    kv = KvBookkeeper(slots=8, prefix_cache=0, n_ctx=8 * 4096, n_batch=512, per_slot=True, invariant=False)
    s = Scheduler(kv, n_batch=512, n_ctx_per_seq=4096, draft_max=6, max_stall_ms=250)
    for i in range(4):
        admit(s, f"d{i}", prompt(10, 100 * i), max_tokens=2000)

    def step() -> list[DecodeCall]:
        calls = s.plan_step().calls
        for call in calls:
            s.update(call, sampled_sevens(call), simulated_seconds(call))
        s.end_step()
        return calls

    def drafted(calls: list[DecodeCall]) -> bool:
        return any(call.drafts for call in calls)

    before = [drafted(step()) for _ in range(12)]
    assert any(before), "the sevens repeat: prompt lookup drafts them"
    (long,) = admit(s, "long", prompt(3000, 50_000))
    beside: list[bool] = []
    while long.next_token is None:
        calls = step()
        if any(call.decoders for call in calls) and any(job is long for c in calls for job, _ in c.prompts):
            beside.append(drafted(calls))
    assert len(beside) > 5 and not any(beside), str(beside)
    after = [drafted(step()) for _ in range(40)]
    assert any(after), str(after)  # the prompt is done: drafting again
