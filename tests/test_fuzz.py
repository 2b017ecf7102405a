"""Fuzz: hypothesis writes 1000+ malformed jobs straight into Redis (raw RQ job hashes and queue
pushes, no producer-side validation) for one real worker on the fake engine. Every one must end
with exactly one final stream entry: a clear refusal for the bad ones, a result for the few that
happen to be valid. The worker never dies and serves a normal job afterwards."""

from __future__ import annotations

import json
import pickle
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis import Redis

from backends.contract.keys import (
    ATTEMPT_FIELD,
    JOB_FUNCTION,
    job_key,
    queue_key,
    stream_key,
    wake_key,
    worker_key,
)
from backends.contract.stream import decode
from dispatcher import Fleet
from tests.reliability_checks import fleet_workers

pytestmark = pytest.mark.timeout(240)
N_PAYLOADS = 1000
# What a refusal says first; anything else (an "internal error", a traceback) is a finding.
CLEAR_REASONS = ("refused: ", "invalid request: ", "expired: waited", "timed out: ")
UNREADABLE = " cannot be read: "

# -- what goes into the job hash ------------------------------------------------------------------

numbers = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, -1, 8192, 8193, 2**31, 2**63, -(2**63)]))
json_values = st.recursive(
    st.none() | st.booleans() | numbers | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
prompts = st.one_of(
    st.text(max_size=40), st.sampled_from(["", "   ", "\x00", "\ud7ff\ue000"]),
    st.just("word " * 250_001),  # over the 1M-character limit
    st.just("long " * 4_000), json_values,
)
roles = st.sampled_from(["user", "system", "assistant", "root"]) | json_values
message = st.fixed_dictionaries({"role": roles, "content": st.text(max_size=20) | json_values})
messages = st.lists(message, max_size=3) | json_values
nearly_valid = st.fixed_dictionaries(  # valid requests, so that odd hash fields meet running jobs too
    {"prompt": st.text(min_size=1, max_size=30).filter(str.strip)},
    optional={"max_tokens": st.integers(1, 16),
              "stop": st.lists(st.text(min_size=1, max_size=4), max_size=2)},
)
requests = st.one_of(
    nearly_valid,
    st.fixed_dictionaries({}, optional={
        "prompt": prompts, "messages": messages, "max_tokens": numbers | json_values,
        "temperature": numbers | json_values, "top_k": numbers, "top_p": numbers, "seed": numbers,
        "stop": st.lists(st.text(max_size=300), max_size=20) | json_values, "surprise": json_values,
    }),
    json_values,
)
functions = st.one_of(st.just(JOB_FUNCTION), st.sampled_from(["os.system", "builtins.eval", "subprocess.run",
                                                              "dispatcher.jobs.generate.__globals__", ""]),
                      json_values)


def json_job_data(draw: st.DrawFn) -> bytes:
    request = draw(requests)
    func = draw(functions)
    args = draw(st.sampled_from(["one", "none", "two", "other"]))
    args_value: Any = {"one": [request], "none": [], "two": [request, request]}.get(args) or draw(json_values)
    kwargs = draw(st.sampled_from([{}, {"request": request}])) if args == "none" else draw(
        st.sampled_from([{}, {}, {"x": 1}]) | json_values)
    body = json.dumps([func, None, args_value, kwargs]).encode()
    return zlib.compress(body) if draw(st.booleans()) else body  # RQ also reads uncompressed data


class Smuggled:  # pickled payloads carry an object whose unpickling would run code
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (eval, ("1/0",))


def raw_job_data(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["pickle", "bytes", "bad-zlib", "zlib-bad-utf8", "json-bad-utf8"]))
    if kind == "pickle":
        return zlib.compress(pickle.dumps((JOB_FUNCTION, None, [Smuggled()], {})))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "bad-zlib":
        return b"x\x9c" + draw(st.binary(min_size=1, max_size=32))
    if kind == "zlib-bad-utf8":
        return zlib.compress(b"\xff\xfe" + draw(st.binary(max_size=32)))
    return zlib.compress(b'["' + JOB_FUNCTION.encode() + b'", null, [{"prompt": "\xc3\x28"}], {}]')


@dataclass
class Payload:
    job_id: bytes
    fields: dict[str, bytes | str] | None  # None: no hash at all; {} with as_string: a string key
    as_string: bool
    queue: str


@st.composite
def payloads(draw: st.DrawFn) -> Payload:
    unique = uuid.uuid4().hex
    id_kind = draw(st.sampled_from(["plain"] * 8 + ["text", "bytes"]))
    job_id = {"plain": unique.encode(), "text": (draw(st.text(max_size=10)) + ":" + unique).encode(),
              "bytes": b"\xff\xfe" + unique.encode()}[id_kind]
    shape = draw(st.sampled_from(["json"] * 6 + ["raw", "no-hash", "string-key", "no-data"]))
    queue = draw(st.sampled_from(["llm:default", "llm:high", "llm:low"]))
    if shape in ("no-hash", "string-key"):
        return Payload(job_id, None, shape == "string-key", queue)
    fields: dict[str, bytes | str] = {"origin": queue, "status": "queued",
                                      "created_at": "2026-11-22T00:00:00.000000Z"}
    if shape != "no-data":
        fields["data"] = json_job_data(draw) if shape == "json" else raw_job_data(draw)
    optional = {
        "enqueued_at": st.sampled_from(["2026-11-22T00:00:00.000000Z", "yesterday", ""]),
        "status": st.sampled_from(["queued", "started", "deferred", "bogus", ""]),
        "timeout": st.sampled_from(["600", "-5", "0", "abc", "10s", "99999999999999999999"]),
        "meta": st.builds(lambda v: json.dumps({"queue_ttl": v}), json_values) | st.binary(max_size=8),
        ATTEMPT_FIELD: st.sampled_from(["0", "1", "-3", "abc", "99"]),
        "success_callback_name": st.just("os.system"),
        "webhooks": st.just(json.dumps([{"url": "http://127.0.0.1:9/", "job_status": "finished"}])),
        "worker_name": st.text(max_size=8),
        "created_at": st.sampled_from(["not a date", ""]),
        "origin": st.text(max_size=12),
    }
    for name in draw(st.lists(st.sampled_from(sorted(optional)), max_size=3, unique=True)):
        fields[name] = draw(optional[name])
    return Payload(job_id, fields, False, queue)


def push(redis: Redis, p: Payload) -> None:
    key = job_key("").encode() + p.job_id
    if p.as_string:
        redis.set(key, "not a hash")
    elif p.fields is not None:
        redis.hset(key, mapping=p.fields)  # type: ignore[arg-type]
    redis.rpush(queue_key(p.queue), p.job_id)
    redis.lpush(wake_key("llm"), 1)


# -- checking what each one left ------------------------------------------------------------------


def finals(redis: Redis, job_id: bytes) -> list[dict[str, Any]]:
    out = []
    for _id, fields in redis.xrange(stream_key("").encode() + job_id):
        ev = decode(fields)
        if ev.final:
            out.append({"kind": ev.kind, **(ev.data or {})})
    return out


def ended(redis: Redis, job_ids: list[bytes]) -> list[bool]:
    """For each job: has its stream's last entry ended it? One round trip for all of them, so
    the polling below does not compete with the worker for the CPU."""
    with redis.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.xrevrange(stream_key("").encode() + job_id, count=1)
        lasts = pipe.execute()
    return [bool(last) and last[0][1][b"k"] in (b"d", b"e") for last in lasts]


def is_clear(error: str) -> bool:
    return error.startswith(CLEAR_REASONS) or UNREADABLE in error


def test_malformed_jobs_fail_clearly_and_the_worker_survives(redis_url: str, redis: Redis,
                                                               tmp_path: Path) -> None:
    pushed: list[Payload] = []
    with fleet_workers(redis_url, tmp_path / "logs") as workers:
        # batch_share 16: low-priority payloads may use every unreserved slot, not 2 per step (the
        # default paces batch jobs beside interactive ones; priorities are not what is under test)
        worker = workers.start("fuzz", backend__type="fake", backend__slots=16, job_timeout=30,
                               batch_share=16)

        @settings(max_examples=N_PAYLOADS, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(payloads())
        def push_one(p: Payload) -> None:
            push(redis, p)
            pushed.append(p)

        push_one()
        deadline = time.monotonic() + 150
        waiting = [p.job_id for p in pushed]
        while waiting and time.monotonic() < deadline:
            waiting = [j for j, done in zip(waiting, ended(redis, waiting), strict=True) if not done]
            time.sleep(0.2)
        assert worker.alive(), worker.output()[-3000:]
        assert not waiting, f"{len(waiting)} payloads never ended, e.g. {waiting[:3]}"
        after = Fleet(redis_url).submit(prompt="still standing", max_tokens=4).result(timeout=20)
        assert after["text"] == "still standing" and redis.exists(worker_key("fuzz"))

    assert len(pushed) >= N_PAYLOADS
    outcomes = {p.job_id: finals(redis, p.job_id) for p in pushed}
    doubles = {j: f for j, f in outcomes.items() if len(f) != 1}
    assert not doubles, f"{len(doubles)} without exactly one final entry: {list(doubles.items())[:3]}"
    errors = [f[0]["error"] for f in outcomes.values() if f[0]["kind"] == "error"]
    unclear = [e for e in errors if not is_clear(e)]
    assert not unclear, f"{len(unclear)} unclear failures, e.g. {unclear[:5]}"
    succeeded = len(pushed) - len(errors)
    print(f"\nfuzz: {len(pushed)} payloads, {len(errors)} refused clearly, {succeeded} valid and ran")
    assert "Traceback" not in worker.output()
