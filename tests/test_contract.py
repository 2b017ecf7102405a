"""The shared contract without servers: backoff, the result object, the stream codec and the
reader's rules (on fakeredis: pure Redis data-structure logic, no process semantics), status
reads, and producer settings."""

from __future__ import annotations

import json
from pathlib import Path

import fakeredis
import pytest
from pydantic import ValidationError

from backends.contract.keys import ATTEMPT_FIELD, WORKERS_SET, job_key, queue_key, stream_key, worker_key
from backends.contract.retry import Backoff
from backends.contract.schema import JobResult, JobResultModel, cancelled_in_queue, job_result
from backends.contract.settings import ProducerSettings, SettingsError, load
from backends.contract.stream import decode, encode_done, encode_error, encode_text
from dispatcher import status
from dispatcher.stream import read_events


def test_backoff_doubles_to_its_cap_and_starts_again_after_reset() -> None:
    b = Backoff(0.1, 1.0)
    assert [b.next() for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    b.reset()
    assert b.next() == 0.1
    assert Backoff(1.0, 30.0).delay(10_000) == 30.0  # a long outage does not overflow


def test_job_result_reads_as_attributes_and_is_the_dict_rq_stores() -> None:
    built = job_result("j1", "Hi there", "length", prompt_tokens=3, completion_tokens=2, worker="w1",
                       backend="fake", attempt=1, queue_ms=1.26, ttft_ms=None, total_ms=20.04,
                       tokens_per_s=99.99)
    stored = json.loads(json.dumps(built.model_dump()))  # what RQ and the stream keep
    res = JobResult(stored)
    assert isinstance(res, dict) and res == stored and json.loads(json.dumps(res)) == stored
    assert res.text == "Hi there" and res.usage.total_tokens == 5 and res.timings.queue_ms == 1.3
    assert res["usage"]["completion_tokens"] == 2 and res.finish_reason == "length"
    with pytest.raises(AttributeError):
        _ = res.no_such_field


def test_a_result_from_another_writer_keeps_exactly_its_fields() -> None:
    partial = JobResult({"text": "ABC", "attempt": 2, "extra_field": 1})
    assert partial == {"text": "ABC", "attempt": 2, "extra_field": 1}
    assert partial.finish_reason == "stop" and partial.worker is None and partial.attempt == 2
    with pytest.raises(ValidationError):
        JobResult({"attempt": "second"})


def test_cancelled_in_queue_is_a_complete_result() -> None:
    res = cancelled_in_queue("j9", attempt=1).model_dump()
    assert res["finish_reason"] == "cancelled" and res["text"] == "" and res["worker"] is None
    assert set(res) == set(JobResultModel.model_fields)


def test_stream_codec_round_trips() -> None:
    def raw(fields: dict[str, object]) -> dict[bytes, bytes]:
        return {k.encode(): str(v).encode() for k, v in fields.items()}

    text = decode(raw(encode_text(2, 5, "tok")))
    assert (text.kind, text.attempt, text.seq, text.text) == ("text", 2, 5, "tok")
    done = decode(raw(encode_done(1, {"text": "x"})))
    assert done.final and done.data == {"text": "x"}
    assert decode(raw(encode_error(1, {"error": "bad"}))).kind == "error"


def test_reader_voids_a_dead_attempt_and_skips_resent_duplicates() -> None:
    r = fakeredis.FakeRedis()
    key = stream_key("j")
    for fields in (encode_text(1, 0, "dead "), encode_text(2, 0, "A"), encode_text(2, 0, "A"),
                   encode_text(2, 1, "B"), encode_done(2, {"text": "AB"})):
        r.xadd(key, fields)  # type: ignore[arg-type]
    events = list(read_events(r, "j", block_ms=10))
    assert [(e.kind, e.text) for e in events] == [("text", "dead "), ("restart", ""), ("text", "A"),
                                                  ("text", "B"), ("done", "")]


def test_reader_starts_at_the_live_attempt() -> None:
    r = fakeredis.FakeRedis()
    r.hset(job_key("j"), ATTEMPT_FIELD, 1)  # one restart so far: attempt 2 is live
    r.xadd(stream_key("j"), encode_text(1, 0, "void"))  # type: ignore[arg-type]
    r.xadd(stream_key("j"), encode_done(2, {"text": "ok"}))  # type: ignore[arg-type]
    assert [e.kind for e in read_events(r, "j", block_ms=10)] == ["done"]


def test_status_lists_live_workers_and_queue_depths() -> None:
    r = fakeredis.FakeRedis()
    r.sadd(WORKERS_SET, "dead", "w1")
    r.hset(worker_key("w1"), mapping={"name": json.dumps("w1"), "inflight": "2"})
    r.hset(worker_key("w2"), mapping={"name": json.dumps("w2")})  # alive, not yet in the set
    r.rpush(queue_key("llm:high"), "a", "b")
    snap = status.snapshot(r, "llm")
    assert [w["name"] for w in snap["workers"]] == ["w1", "w2"]
    assert [(q["priority"], q["depth"]) for q in snap["queues"]] == [("high", 2), ("default", 0), ("low", 0)]


def test_producer_settings_ignore_worker_keys_but_check_their_own(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEET_CONFIG", raising=False)
    cfg = tmp_path / "worker-config.json"
    cfg.write_text(json.dumps({"pool": "gpu", "backend": {"type": "llama-cpp"}, "cpus": "0-1"}))
    assert load(ProducerSettings, cfg).pool == "gpu"
    monkeypatch.setenv("FLEET_RESULT_TTL", "0")
    with pytest.raises(SettingsError, match="result_ttl"):
        load(ProducerSettings, cfg)
