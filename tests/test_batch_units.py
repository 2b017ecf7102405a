"""Pure parts of batches: line checks, job ids, compact results, and the claim reserve policy."""

from __future__ import annotations

import json

from backends.contract.batch.line_record import compact_ending, line_job_id, line_key, parse_job_id
from dispatcher.gateway.batch.lines import parse_line, scan
from dispatcher.gateway.batch.record import decode_line, queued_value
from worker.claiming.priority import ClaimPolicy, auto_reserved, claim_limits

QUEUES = ["llm:high", "llm:default", "llm:low"]


def line(custom_id: str = "a", url: str = "/v1/completions", **body: object) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": "llm", "prompt": "Hi", **body}})


def test_a_good_line_becomes_a_fleet_request() -> None:
    parsed = parse_line(1, line(max_tokens=4, temperature=0, stop="\n"))
    assert parsed.kind == "text" and parsed.model == "llm" and parsed.key == line_key("a")
    assert parsed.request == {"prompt": "Hi", "max_tokens": 4, "temperature": 0.0, "stop": ["\n"]}


def test_bad_lines_are_named_by_number_and_field() -> None:
    text = [line("a"), "not json", line("b", temperature=9), line("c", url="/v1/embeddings"), "",
            line("a"), json.dumps({"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": {},
                                   "extra": 1}), line("e", n=2), line("f", stream=True)]
    found = scan(text)
    got = {(e.number, e.field) for e in found.errors}
    assert got == {(2, "(line)"), (3, "body.temperature"), (4, "url"), (6, "custom_id"), (7, "extra"),
                   (8, "body.n"), (9, "body.stream")}
    assert found.valid == 1 and found.invalid == 7


def test_one_model_per_batch() -> None:
    other = json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/completions",
                        "body": {"model": "other", "prompt": "x"}})
    found = scan([line("a"), other])
    assert [(e.number, e.field) for e in found.errors] == [(2, "body.model")]


def test_job_ids_carry_the_batch_and_line() -> None:
    key = line_key("req-1")
    job_id = line_job_id("batch_x-y", key)
    assert parse_job_id(job_id) == ("batch_x-y", key)
    assert parse_job_id("0123456789abcdef0123") is None
    assert parse_job_id("fbatch--" + key) is None  # empty batch id


def test_compact_endings_round_trip() -> None:
    result = {"text": "hi", "finish_reason": "length", "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    state, payload, prompt, completion = compact_ending(result, None, 100.0)
    assert (state, prompt, completion) == ("d", 3, 2)
    stored = decode_line(state + queued_value("chat", "id\n1")[1:] + "\n" + payload)
    assert stored.custom_id == "id\n1" and stored.kind == "chat"
    assert stored.result == {"t": "hi", "f": "length", "p": 3, "c": 2, "at": 100}
    assert compact_ending(None, "boom", 1.0)[0] == "f"
    assert compact_ending({"finish_reason": "cancelled"}, None, 1.0)[0] == "x"


def test_low_jobs_leave_the_reserve_free() -> None:
    # 16 slots, 2 reserved: with 14 low jobs running, 2 free slots are for high/default only
    order = ["high", "default", "low"]
    assert claim_limits(order, free=2, slots=16, low_in_flight=14, reserved=2) == [2, 2, 0]
    # an idle worker takes at most 14 low jobs in one claim
    assert claim_limits(order, free=16, slots=16, low_in_flight=0, reserved=2) == [16, 16, 14]
    # interactive jobs running count against the low room too (via the peak), and beside them low
    # jobs get at most batch_share per interactive job (6 interactive: 3 low)
    assert claim_limits(order, free=6, slots=16, low_in_flight=1, reserved=2, interactive_peak=6) == [6, 6, 2]
    assert claim_limits(order, free=6, slots=16, low_in_flight=4, reserved=2, interactive_peak=6) == [6, 6, 0]
    assert claim_limits(order, free=6, slots=16, low_in_flight=0, reserved=2, interactive_peak=6,
                        batch_share=2.0) == [6, 6, 6]
    # one interactive user still leaves the batch one slot
    one_user = claim_limits(order, free=15, slots=16, low_in_flight=0, reserved=2, interactive_peak=1)
    assert one_user == [15, 15, 1]
    assert auto_reserved(16) == 2 and auto_reserved(4) == 1 and auto_reserved(2) == 0


def test_a_recent_interactive_peak_keeps_its_slots() -> None:
    policy = ClaimPolicy(16, 2, QUEUES, window=30)
    held = ["llm:high"] * 8
    assert policy.limits(8, held, now=0.0) == [8, 8, 4]  # 8 interactive: 4 low (batch_share 0.5)
    # the users paused: their slots stay free of low jobs for the window
    assert policy.limits(16, [], now=10.0) == [16, 16, 4]
    assert policy.limits(16, [], now=31.0) == [16, 16, 14]
