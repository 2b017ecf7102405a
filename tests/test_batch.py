"""Batches end to end: real redis-server, real `fleet worker` processes, the real `fleet` CLI
and gateway, the official openai client. The workers run the fake engine, paced like a small
model: a batch's lines are jobs like any other, the same for every engine."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from redis import Redis

from backends.contract.keys import batch_key, queue_key
from dispatcher.gateway.batch.record import read_state
from tests.gateway_harness import Gateways, wait_until_healthy
from tests.harness import ROOT, default_sigint, wait_for, worker_env

# the fake engine says the prompt back a word a step: each line's prompt has words for its max_tokens
FAKE = {"backend__type": "fake", "backend__step_delay": 0.02}


def write_batch(path: Path, n: int, max_tokens: int = 1, url: str = "/v1/completions") -> Path:
    with path.open("w") as f:
        for i in range(n):
            body = {"model": "llm", "prompt": f"Item {i}: one two three four five", "max_tokens": max_tokens,
                    "temperature": 0}
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}) + "\n")
    return path


def fleet(redis_url: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "ecosystem.cli", "batch", *args]


def run(redis_url: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(fleet(redis_url, *args), env=worker_env(redis_url, "cli"), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def count(redis: Redis, batch_id: str, field: str) -> int:
    return int(redis.hget(batch_key(batch_id), field) or 0)


def wait_state(redis: Redis, batch_id: str, states: tuple[str, ...], timeout: float) -> dict[str, Any]:
    def ended() -> dict[str, Any] | None:
        state = read_state(redis, batch_id)
        return state if state and state["state"] in states else None

    return wait_for(ended, timeout, f"batch {batch_id} to reach {states}", interval=0.5)  # type: ignore[no-any-return]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_file_with_bad_lines_is_refused_naming_lines_and_fields(redis: Redis, redis_url: str,
                                                                   tmp_path: Path) -> None:
    path = write_batch(tmp_path / "in.jsonl", 8)
    lines = path.read_text().splitlines()
    lines[1] = lines[1].replace('"temperature": 0', '"temperature": 9')
    lines[3] = lines[3].replace("/v1/completions", "/v1/embeddings")
    lines[6] = lines[6].replace('"req-6"', '"req-0"')
    path.write_text("\n".join(lines) + "\n")
    out = run(redis_url, "submit", str(path))
    assert out.returncode != 0
    assert "line 2: body.temperature" in out.stderr
    assert "line 4: url" in out.stderr
    assert "line 7: custom_id: duplicate custom_id 'req-0' of line 1" in out.stderr
    assert "3 bad line(s); nothing was enqueued" in out.stderr
    assert not redis.keys("rq:queue:*") and not redis.keys("fleet:batch*") and not redis.keys("rq:job:*")


@pytest.mark.slow
def test_1000_lines_two_workers_one_killed_and_the_submit_interrupted(redis: Redis, redis_url: str,
                                                                      workers: Any, tmp_path: Path) -> None:
    first = workers.start("batch-w1", **FAKE, backend__slots=16)  # a real worker's default slots
    workers.start("batch-w2", **FAKE, backend__slots=16)
    path = write_batch(tmp_path / "in.jsonl", 1000)
    args = ("submit", str(path), "--id", "big", "--chunk-size", "1")
    submitter = subprocess.Popen(fleet(redis_url, *args), env=worker_env(redis_url, "cli"), cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 preexec_fn=default_sigint)
    wait_for(lambda: count(redis, "big", "enqueued") >= 50, 120, "50 lines enqueued", interval=0.01)
    submitter.send_signal(signal.SIGINT)  # Ctrl-C mid-enqueue
    submitter.communicate(timeout=60)
    assert submitter.returncode != 0
    interrupted_at = count(redis, "big", "enqueued")
    assert 50 <= interrupted_at < 1000
    assert read_state(redis, "big")["state"] == "validating"  # type: ignore[index]

    again = run(redis_url, *args[:-2], "--chunk-size", "100")  # the same command, re-run
    assert again.returncode == 0, again.stderr
    assert f"big: resumed, {1000 - interrupted_at} lines enqueued now" in again.stdout
    assert count(redis, "big", "enqueued") == 1000

    wait_for(lambda: count(redis, "big", "completed") >= 150 or None, 600, "150 lines done", interval=0.2)
    first.kill()  # kill -9 mid-batch: its lines go back to the queue (reaper) and run on the other
    state = wait_state(redis, "big", ("completed",), 900)
    assert state["completed"] == 1000 and state["failed"] == 0 and state["enqueued"] == 1000
    assert run(redis_url, *args).stdout.startswith("big: resumed, 0 lines enqueued now")

    out = tmp_path / "out.jsonl"
    done = run(redis_url, "results", "big", "-o", str(out))
    assert done.returncode == 0, done.stderr
    results = read_jsonl(out)
    assert len(results) == 1000
    assert sorted(r["custom_id"] for r in results) == sorted(f"req-{i}" for i in range(1000))
    for r in results:
        assert set(r) == {"id", "custom_id", "response", "error"} and r["error"] is None
        assert r["response"]["status_code"] == 200 and r["response"]["request_id"]
        body = r["response"]["body"]
        assert body["object"] == "text_completion" and body["model"] == "llm"
        assert body["usage"]["completion_tokens"] == 1 and body["choices"][0]["finish_reason"] == "length"


def test_cancel_drops_the_queued_lines_and_stops_the_rest(redis: Redis, redis_url: str, workers: Any,
                                                         tmp_path: Path) -> None:
    workers.start("cancel-w1", **{**FAKE, "backend__step_delay": 0.05}, backend__slots=4)
    path = write_batch(tmp_path / "in.jsonl", 300, max_tokens=4)
    assert run(redis_url, "submit", str(path), "--id", "stop-me").returncode == 0
    wait_for(lambda: count(redis, "stop-me", "completed") >= 10, 300, "10 lines done", interval=0.2)
    out = run(redis_url, "cancel", "stop-me")
    assert out.returncode == 0, out.stderr
    state = wait_state(redis, "stop-me", ("cancelled",), 120)
    assert state["completed"] < 300 and state["cancelled"] > 0
    assert state["completed"] + state["failed"] + state["cancelled"] == 300
    # cancelled lines are tombstones until the worker's next claims drop them from the queue
    wait_for(lambda: not any(b"fbatch-stop-me-" in j for q in redis.keys("rq:queue:*")
                             for j in redis.lrange(q, 0, -1)), 60, "the cancelled lines to leave the queue")
    time.sleep(2)
    assert read_state(redis, "stop-me")["completed"] == state["completed"]  # type: ignore[index]
    ok, errors = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    assert run(redis_url, "results", "stop-me", "-o", str(ok), "--errors", str(errors)).returncode == 0
    assert len(read_jsonl(ok)) == state["completed"]
    failed = read_jsonl(errors)
    assert len(failed) == state["cancelled"] + state["failed"]
    assert {r["error"]["code"] for r in failed} <= {"batch_cancelled", "job_failed"}
    assert failed[0]["response"] is None
    assert redis.llen(queue_key("llm:low")) == 0


def test_the_openai_client_runs_a_batch_through_the_gateway(redis: Redis, workers: Any, gateways: Gateways,
                                                             tmp_path: Path) -> None:
    workers.start("openai-w1", **FAKE, backend__slots=4)
    gw = gateways.start()
    wait_until_healthy(gw)
    client = OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    data = write_batch(tmp_path / "in.jsonl", 5, max_tokens=3).read_bytes()
    uploaded = client.files.create(file=("in.jsonl", data), purpose="batch")
    assert uploaded.bytes == len(data) and client.files.retrieve(uploaded.id).filename == "in.jsonl"
    assert client.files.content(uploaded.id).content == data
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                  completion_window="24h", metadata={"run": "test"})
    assert batch.status in ("in_progress", "completed") and batch.request_counts.total == 5  # type: ignore[union-attr]
    deadline = time.monotonic() + 240
    while batch.status not in ("completed", "failed", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 5  # type: ignore[union-attr]
    assert batch.output_file_id and batch.error_file_id is None and batch.metadata == {"run": "test"}
    lines = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in lines) == [f"req-{i}" for i in range(5)]
    assert all(x["response"]["body"]["usage"]["completion_tokens"] == 3 for x in lines)
    assert batch.id in [b.id for b in client.batches.list()]
    # a file with a bad line: the batch is created failed, naming the line (as OpenAI does)
    bad = client.files.create(file=("bad.jsonl", data.replace(b'"max_tokens": 3', b'"max_tokens": -1', 1)),
                              purpose="batch")
    failed = client.batches.create(input_file_id=bad.id, endpoint="/v1/completions", completion_window="24h")
    assert failed.status == "failed" and failed.errors and failed.errors.data
    assert failed.errors.data[0].line == 1 and failed.errors.data[0].param == "body.max_tokens"
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "completed"  # an ended batch stays as it ended
