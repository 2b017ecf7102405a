"""Prompt-lookup speculation without a model: what a job proposes, and when the scheduler lets it
(drafts ride in the decoders' call while it stays within DRAFT_CALL_ROWS rows)."""

from __future__ import annotations

from backends.contract.schema import GenerateRequest, SamplingDefaults
from backends.llamacpp.scheduler import DecodeCall, Scheduler
from backends.llamacpp.speculation import DRAFT_CALL_ROWS, NgramIndex, StepCosts, draft_room
from backends.llamacpp.state import ActiveJob
from tests.engine_state import admit, engine, execute, prompt


def test_a_repeated_ngram_proposes_what_followed_it_last_time() -> None:
    index = NgramIndex([5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 3, 4, 5, 6])
    # longest suffix first: (5, 6) was last followed by 7, 3, 4, ...
    assert index.propose(3) == [7, 3, 4]
    index.append(7)  # suffix (5, 6, 7): last seen before 3
    assert index.propose(2) == [3, 4]
    assert index.propose(0) == []


def test_no_match_no_draft_and_single_tokens_do_not_count() -> None:
    assert NgramIndex([1, 2, 3, 4]).propose(4) == []
    assert NgramIndex([1, 9, 1]).propose(4) == []  # a one-token match is below NGRAM_MIN
    assert NgramIndex([]).propose(4) == []


def test_in_a_loop_the_first_occurrence_gives_the_longer_draft() -> None:
    # the latest (1, 2, 1, 2) is followed by two tokens only; the first one by the whole tail
    assert NgramIndex([1, 2, 1, 2, 1, 2, 1, 2]).propose(3) == [1, 2, 1]
    assert NgramIndex([1, 2, 1, 2, 1, 2]).propose(5) == [1, 2]  # no more than the tokens hold


def test_the_index_follows_the_output_as_it_grows() -> None:
    index = NgramIndex([10, 11, 12, 13])
    output = [10, 11]
    index.follow(output)
    assert index.propose(2) == [12, 13]
    output += [12, 99]
    index.follow(output)
    index.follow(output)  # nothing new: nothing appended twice
    assert index.tokens == [10, 11, 12, 13, 10, 11, 12, 99]
    assert index.propose(1) == []


def test_draft_room_keeps_the_call_within_the_logits_rows() -> None:
    assert [draft_room(n, 6) for n in range(1, 10)] == [6, 6, 4, 3, 2, 1, 1, 1, 0]
    assert draft_room(1, 16) == 6  # a lone decoder stays with its own (per-row) kernel
    assert draft_room(1, 3) == 3 and draft_room(0, 6) == 0
    assert all(n * (1 + draft_room(n, 16)) <= DRAFT_CALL_ROWS for n in range(1, 20) if draft_room(n, 16))


def test_the_budget_weighs_the_undrafted_decoders_tokens_too() -> None:
    index = NgramIndex([1, 2, 3])  # the prior record: ~0.9 of draft tokens kept
    costs = [1.0, 1.3, 1.6]
    assert index.budget(costs) == 2  # alone: 2.71 tokens for 1.6 beats 1 for 1
    # beside 7 undrafted decoders the call gives 8 tokens for 1.0 undrafted, 9.9 for 1.3 drafted
    assert index.budget(costs, others=7.0) == 0


def _decoding(s: Scheduler, n: int, tokens: list[int], max_tokens: int = 1000) -> list[ActiveJob]:
    for i in range(n):
        admit(s, f"d{i}", tokens, max_tokens=max_tokens)
    while any(j.next_token is None for j in s.active.values()):
        execute(s, s.plan_step())
    return list(s.active.values())


def _decoders_call(s: Scheduler) -> DecodeCall:
    (call,) = [c for c in s.plan_step().calls if c.decoders]
    return call


# the test executor samples token 7 every time: a prompt of 7s makes a draft of 7s
SEVENS = [3, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]


def test_a_lone_decoder_verifies_its_draft_in_one_wider_row_group() -> None:
    s = engine(draft_max=6)
    (job,) = _decoding(s, 1, SEVENS)
    call = _decoders_call(s)
    assert call.drafts == {job.seq_id: [7] * 6}
    assert call.span == (job.seq_id, job.seq_id) and call.width == 7 and call.n_rows() == 7


def test_drafts_shrink_with_more_decoders_and_stop_at_nine() -> None:
    # untimed shapes cost the prior: m decoders drafting j tokens each, 1 + 0.2 m j calls
    for n, width in [(2, 5), (3, 3), (4, 2), (8, 1), (9, 1), (16, 1)]:
        s = engine(draft_max=6)
        _decoding(s, n, SEVENS)
        call = _decoders_call(s)
        assert call.width == width, n
        assert call.n_rows() <= DRAFT_CALL_ROWS or not call.drafts
        if width == 1:
            assert not call.drafts


def test_timed_calls_decide_how_far_several_decoders_draft() -> None:
    s = engine(draft_max=6)
    _decoding(s, 4, SEVENS)
    base = (4, 4)
    for _ in range(3):  # as timed on a 2-core EPYC: 4 rows 33 ms, 4 x 4 rows 58 ms, 4 x 7 rows 92 ms
        for shape, ms in [(base, 33), ((8, 8), 42), ((12, 12), 53), ((16, 16), 58)]:
            s.costs.record(*shape, ms / 1000)
    assert _decoders_call(s).width == 4  # 4 x 3.4 tokens for 58 ms beats 4 for 33
    costly = StepCosts()
    for _ in range(3):
        for shape, ms in [(base, 33), ((8, 8), 70), ((12, 12), 100), ((16, 16), 130)]:
            costly.record(*shape, ms / 1000)
    s.costs = costly
    assert _decoders_call(s).width == 1  # drafts that cost more than they give: none


def test_drafts_stop_short_of_the_fullest_streams_last_cell() -> None:
    s = engine(slots=3, prefix_cache=0, draft_max=6, n_ctx_per_seq=64)
    _decoding(s, 3, SEVENS)
    s.release(s.active["d1"])  # slot 1 keeps its KV; decoders 0 and 2 draft over ids 0..2
    assert _decoders_call(s).width == 5
    s.kv.slot_kv[1].tokens = [7] * 62  # 2 cells left there: every id gets the widest draft's rows
    call = _decoders_call(s)
    assert call.span == (0, 2) and call.width == 2


def test_no_draft_past_max_tokens_nor_without_a_match() -> None:
    s = engine(draft_max=6)
    (job,) = _decoding(s, 1, SEVENS, max_tokens=3)  # one token generated, two to go
    assert _decoders_call(s).drafts == {job.seq_id: [7]}  # the next token + one draft
    s = engine(draft_max=6)
    _decoding(s, 1, prompt(20))  # distinct tokens: nothing to look up
    call = _decoders_call(s)
    assert not call.drafts and call.width == 1


def test_speculation_off_by_setting() -> None:
    s = engine(draft_max=0)
    (job,) = _decoding(s, 1, SEVENS)
    assert job.ngrams is None
    assert all(not c.drafts for c in s.plan_step().calls)


def test_in_the_unified_pool_drafts_stay_within_the_logits_rows_and_apart_from_prompts() -> None:
    s = engine(draft_max=6, per_slot=False)
    (job,) = _decoding(s, 1, SEVENS)
    (call,) = s.plan_step().calls
    assert call.drafts == {job.seq_id: [7] * 6} and call.span is None and call.n_rows() == 7
    for n in (2, 3, 4, 9):  # 9 decoders: no room in the logits rows
        s = engine(draft_max=6, per_slot=False)
        _decoding(s, n, SEVENS)
        (call,) = s.plan_step().calls
        assert call.n_rows() <= DRAFT_CALL_ROWS and bool(call.drafts) == (n < 9), n
    admit(s, "newcomer", prompt(5))  # a prompt chunk in the call: no drafts beside it
    (call,) = s.plan_step().calls
    assert call.prompts and not call.drafts and not call.pad


def test_a_lone_undrafted_row_in_the_unified_pool_gets_a_throwaway_second_row() -> None:
    for draft_max in (0, 6):  # the same kernels with speculation on or off
        s = engine(draft_max=draft_max, per_slot=False)
        _decoding(s, 1, prompt(20))  # distinct tokens: nothing to look up
        (call,) = s.plan_step().calls
        assert not call.drafts and call.pad and call.n_rows() == 2
        admit(s, "second", prompt(20, 500), max_tokens=1000)
        execute(s, s.plan_step())
        (call,) = s.plan_step().calls
        assert len(call.decoders) == 2 and not call.pad


def test_jobs_with_a_grammar_penalties_or_logprobs_never_draft() -> None:
    for fields in ({"format": "json"}, {"presence_penalty": 0.5}, {"repeat_penalty": 1.2},
                   {"logprobs": True, "top_logprobs": 2}):
        s = engine(draft_max=6)
        req = GenerateRequest(prompt="-", max_tokens=100, temperature=0.0, **fields)
        s.enqueue("x", SEVENS, req.sampling(SamplingDefaults()))
        (job,) = s.start_waiting()
        while job.next_token is None:
            execute(s, s.plan_step())
        assert job.ngrams is None, fields
        assert not _decoders_call(s).drafts, fields


def test_a_job_drafts_as_far_as_its_acceptance_pays_for_the_rows() -> None:
    from backends.llamacpp.speculation import PROBE_EVERY

    linear = [1 + 0.2 * j for j in range(7)]  # each draft row a fifth of a step
    stairs = [1.0, 2.3, 2.5, 2.7, 4.3, 4.7, 5.2]  # ggml's kernels on one CPU (docs/bench.md)
    index = NgramIndex([1, 2, 3])
    # no record yet: a good drafter (p = 0.9) until shown otherwise
    assert index.budget(linear) == 6
    assert index.budget(stairs) == 3  # 3.44 tokens for 2.7 steps beats 5.2 for 5.2
    assert index.budget(linear[:3]) == 2  # never more than the costs allow
    for _ in range(8):  # 2 of 6 kept each time: p ~ 2/3
        index.record(6, 2)
    assert index.budget(linear) == 3 and index.budget(stairs) == 0
    for _ in range(8):  # nothing kept
        index.record(1, 0)
    budgets = [index.budget(stairs) for _ in range(PROBE_EVERY)]
    assert sorted(budgets) == [0] * (PROBE_EVERY - 1) + [1]  # no drafts, but a probe now and then
    for _ in range(8):  # copying: every draft kept
        index.record(6, 6)
    assert index.budget(linear) == 6 and index.budget(linear[:3]) == 2
    assert index.budget(stairs) == 3  # 4 tokens for 2.7 steps beats 7 for 5.2


def test_step_costs_are_learned_from_timings_and_trusted_after_a_few() -> None:
    from backends.llamacpp.speculation import PRIOR_ROW_COST, TIMINGS_TRUSTED, StepCosts

    costs = StepCosts()
    assert costs.relative((4, 4), (1, 1)) == 1 + 3 * PRIOR_ROW_COST  # untimed: the prior
    for _ in range(TIMINGS_TRUSTED):
        costs.record(1, 1, 0.010)
        costs.record(4, 4, 0.027)
    costs.record(4, 4, 9.0)  # one step the box stalled: the median ignores it
    assert abs(costs.relative((4, 4), (1, 1)) - 2.7) < 1e-9
    assert costs.relative((2, 2), (1, 1)) == 1 + PRIOR_ROW_COST  # another shape: still the prior
    assert costs.relative((2, 1), (1, 1)) == 1.0  # ... where a throw-away row costs nothing
