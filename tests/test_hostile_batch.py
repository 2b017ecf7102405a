"""Batches, files and the dashboard against hostile input and other tenants: real redis-server,
real `fleet serve`, real `fleet worker` (the fake backend where only bookkeeping matters, the
model for one end to end), plain httpx."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis
from redis.exceptions import ResponseError

from backends.contract.keys import BATCHES_INDEX, batch_key, batch_lines_key, job_key, queue_key
from backends.contract.replies import as_str
from dispatcher.gateway.batch import control, record, submit
from dispatcher.gateway.batch.lines import scan
from dispatcher.gateway.batch.submit import BatchRefused, BatchSpec, submit_batch
from ecosystem.local.processes import RedisServer, free_port
from tests.gateway_harness import Gateways, wait_until_healthy
from tests.harness import ROOT, wait_for, worker_env
from tests.reliability_checks import fleet_workers

pytestmark = pytest.mark.timeout(300)
FAKE = {"backend__type": "fake", "backend__slots": 4}


def jsonl(n: int, prefix: str = "req", max_tokens: int = 2, prompt: str = "Item") -> bytes:
    rows = [{"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "llm", "prompt": f"{prompt} {i}:", "max_tokens": max_tokens}}
            for i in range(n)]
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def upload(url: str, data: bytes, key: str | None = None) -> httpx.Response:
    return httpx.post(f"{url}/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"},
                      headers=auth(key), timeout=60)


def create(url: str, file_id: str, key: str | None = None, window: Any = "24h") -> httpx.Response:
    return httpx.post(f"{url}/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                 "completion_window": window}, headers=auth(key), timeout=60)


def batch_of(url: str, data: bytes, key: str | None = None) -> dict[str, Any]:
    up = upload(url, data, key)
    assert up.status_code == 200, up.text
    made = create(url, up.json()["id"], key)
    assert made.status_code == 200, made.text
    body: dict[str, Any] = made.json()
    return body


def no_key_without_ttl(redis: Redis) -> None:
    """Every fleet:batch*/fleet:file* key ends with a TTL, of at most 31 + 365 days."""
    for pattern in ("fleet:batch*", "fleet:file*"):
        for key in redis.scan_iter(pattern):
            ttl = redis.ttl(key)
            assert 0 < ttl <= 396 * 86400, (key, ttl)


# -- 1. bad batch input -----------------------------------------------------------------------------


def test_completion_window_takes_only_bounded_ascii_hours(redis: Redis, gateways: Gateways) -> None:
    gw = gateways.start()
    file_id = upload(gw.url, jsonl(2)).json()["id"]
    for window in ("²h", "1" * 21 + "h", "99999999999h", "0h", "169h", "٣h", "24", 24, " 24h"):
        got = create(gw.url, file_id, window=window)
        assert got.status_code == 400, (window, got.status_code, got.text)
        assert got.json()["error"]["param"] == "completion_window"
        assert str(window) in got.json()["error"]["message"]
    assert create(gw.url, file_id, window="168h").json()["completion_window"] == "168h"
    no_key_without_ttl(redis)


def test_the_create_script_never_leaves_a_record_without_ttl(redis: Redis) -> None:
    lines = jsonl(1).decode().split("\n")
    for deadline in (10**21, -5, int(time.time()) - 1):
        with pytest.raises(ResponseError):  # before: the HSET ran, then EXPIREAT failed
            submit._create(redis, BatchSpec("ttl-check", "llm"), scan(lines), time.time(), deadline)
        assert not redis.exists(batch_key("ttl-check"))
    with pytest.raises(BatchRefused):  # and no window or retention that Redis could not hold
        submit_batch(redis, BatchSpec("ttl-check", "llm", window=10**20), lambda: lines)
    no_key_without_ttl(redis)


def test_hostile_lines_are_line_errors_not_500(redis: Redis, gateways: Gateways) -> None:
    gw = gateways.start()
    deep = {"custom_id": "deep", "method": "POST", "url": "/v1/completions",
            "body": {"model": "llm", "prompt": "x", "stop": [0]}}
    text = json.dumps(deep).replace("[0]", "[" * 100_000 + "]" * 100_000)
    lone = '{"custom_id": "\\ud800", "method": "POST", "url": "/v1/completions", ' \
           '"body": {"model": "llm", "prompt": "x"}}'
    for data, number in ((text.encode() + b"\n", 1), (jsonl(1) + (lone + "\n" + lone + "\n").encode(), 2)):
        made = create(gw.url, upload(gw.url, data).json()["id"])
        assert made.status_code == 200, made.text
        body = made.json()
        assert body["status"] == "failed" and body["errors"]["data"][0]["line"] == number, body
    # U+2028 / U+0085 / U+2029 inside JSON strings are text, not line breaks; \r\n is one break
    odd = jsonl(3, prompt="a\u2028b\u0085c\u2029d").replace(b"\n", b"\r\n", 1)
    body = batch_of(gw.url, odd)
    assert body["status"] == "in_progress" and body["request_counts"]["total"] == 3, body
    assert scan(["[" * 5000 + "]" * 5000]).errors[0].field == "(line)"
    no_key_without_ttl(redis)


def test_api_ids_never_reach_internal_keys(redis: Redis, redis_url: str, gateways: Gateways) -> None:
    gw = gateways.start()
    batch = batch_of(gw.url, jsonl(2))
    bid = batch["id"]
    assert redis.exists(batch_lines_key(bid))
    for path in (f"/v1/batches/{bid}:lines", f"/v1/batches/{bid}:lock", f"/v1/files/file-out-{bid}:lines",
                 f"/v1/files/file-out-{bid}:lines/content", f"/v1/files/file-err-{bid}:lines",
                 "/v1/batches/batch_1", "/v1/files/file-x"):
        got = httpx.get(gw.url + path, timeout=10)
        assert got.status_code == 404, (path, got.status_code, got.text)
    assert httpx.post(f"{gw.url}/v1/batches/{bid}:lines/cancel", timeout=10).status_code == 404
    assert httpx.get(f"{gw.url}/v1/batches/{bid}", timeout=10).json()["status"] == "in_progress"
    env = worker_env(redis_url, "cli")
    for command in ("status", "cancel"):
        out = subprocess.run([sys.executable, "-m", "ecosystem.cli", "batch", command, f"{bid}:lines"],
                             env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "no batch" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert record.read_state(redis, bid)["state"] == "in_progress"  # type: ignore[index]


# -- 2. admission: a batch neither locks out interactive users nor passes its own cap ---------------


def test_a_queued_batch_leaves_interactive_requests_admitted(redis: Redis, workers: Any,
                                                             gateways: Gateways) -> None:
    workers.start("busy", **FAKE, backend__step_delay=0.5)  # 3 low slots at most: the rest stays queued
    gw = gateways.start(gateway__max_batch_queue=2000)
    wait_until_healthy(gw)
    first = batch_of(gw.url, jsonl(1100, max_tokens=64))
    assert first["status"] == "in_progress"
    assert redis.llen(queue_key("llm:low")) > 1000
    for priority in ("default", "high"):
        got = httpx.post(f"{gw.url}/v1/completions", json={"model": "llm", "prompt": "hi", "max_tokens": 2},
                         headers={"X-Fleet-Priority": priority}, timeout=60)
        assert got.status_code == 200, (priority, got.text)
    low = httpx.post(f"{gw.url}/v1/completions", json={"model": "llm", "prompt": "hi", "max_tokens": 2},
                     headers={"X-Fleet-Priority": "low"}, timeout=60)
    assert low.status_code == 429  # a low job does wait behind the batch: max_queue counts it
    second = upload(gw.url, jsonl(1100, prefix="b", max_tokens=64)).json()["id"]
    refused = create(gw.url, second)
    assert refused.status_code == 429, refused.text
    message = refused.json()["error"]["message"]
    assert "gateway.max_batch_queue" in message and "2000" in message and "1100" in message
    assert redis.zcard(BATCHES_INDEX) == 1  # nothing was recorded for the refused batch
    no_key_without_ttl(redis)


# -- 3. cancel: exactly one batch, in bounded chunks; no race with the submitter ---------------------


def _submit(redis: Redis, batch_id: str, n: int) -> None:
    lines = jsonl(n, prefix=batch_id).decode().split("\n")
    submit_batch(redis, BatchSpec(batch_id, "llm"), lambda: lines)


def _queued(redis: Redis) -> list[str]:
    return [as_str(j) or "" for j in redis.lrange(queue_key("llm:low"), 0, -1)]


def test_cancel_takes_only_its_own_batch_in_bounded_chunks(tmp_path: Path) -> None:
    # a private server: its command counts are this test's alone (the shared one may still serve
    # a client an earlier test left shutting down)
    logs = tmp_path / "logs"
    with RedisServer.start(tmp_path / "redis") as server, fleet_workers(server.url, logs) as workers:
        _cancel_in_bounded_chunks(server.client(), workers)


def _cancel_in_bounded_chunks(redis: Redis, workers: Any) -> None:
    _submit(redis, "nightly", 2)
    _submit(redis, "nightly-2", 2)
    others = [j for j in _queued(redis) if j.startswith("fbatch-nightly-2-")]
    assert control.cancel(redis, "nightly") == "cancelled"
    assert [j for j in _queued(redis) if j.startswith("fbatch-nightly-2-")] == others
    assert all(redis.hget(job_key(j), "status") == b"queued" for j in others)
    assert record.read_state(redis, "nightly-2")["cancelled"] == 0  # type: ignore[index]

    _submit(redis, "big", 1100)
    _submit(redis, "small", 300)
    before_small = [j for j in _queued(redis) if j.startswith("fbatch-small-")]
    redis.config_resetstat()
    assert control.cancel(redis, "big") == "cancelled"
    stats = redis.info("commandstats")
    calls = {name.removeprefix("cmdstat_"): v["calls"] for name, v in stats.items()}
    # no queue is read whole, rewritten or searched: only the batch's own lines, in chunks
    assert not any(calls.get(c) for c in ("lrange", "lrem", "rpush", "lpop", "lset")), calls
    # (+4: a worker an earlier test left on this port may poll once: commandstats counts every client)
    assert calls.get("evalsha", 0) + calls.get("eval", 0) <= math.ceil(1100 / control.CANCEL_CHUNK) + 4, calls
    assert calls.get("hscan", 0) >= 1100 // control.CANCEL_CHUNK
    state = record.read_state(redis, "big")
    assert state is not None and state["cancelled"] == 1100 and state["completed"] == 0
    assert [j for j in _queued(redis) if j.startswith("fbatch-small-")] == before_small
    tombstones = [j for j in _queued(redis) if j.startswith("fbatch-big-")]
    assert len(tombstones) == 1100 and all(redis.ttl(job_key(j)) > 0 for j in tombstones)
    # a worker drops big's queue entries at claim and runs small's lines
    workers.start("drain", **FAKE)
    wait_for(lambda: (record.read_state(redis, "small") or {}).get("state") == "completed", 120, "small done")
    wait_for(lambda: not _queued(redis), 60, "the tombstones to leave the queue")
    assert record.read_state(redis, "big")["completed"] == 0  # type: ignore[index]
    no_key_without_ttl(redis)


def test_cancel_survives_junk_in_a_line_job(redis: Redis) -> None:
    _submit(redis, "junk", 3)
    first, second, _ = _queued(redis)
    redis.hset(job_key(first), "fleet_owner", "ghost")
    redis.set("fleet:inflight:ghost", "not a list", ex=60)
    redis.delete(job_key(second))
    redis.set(job_key(second), "not a hash", ex=60)
    assert control.cancel(redis, "junk") == "cancelled"
    state = record.read_state(redis, "junk")
    assert state is not None and state["cancelled"] == 3
    no_key_without_ttl(redis)


def test_a_cancel_during_submit_enqueues_nothing_more(redis: Redis, redis_url: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    other = Redis.from_url(redis_url)
    real = record.queued_value
    fired: list[str] = []

    def cancel_midway(kind: Any, custom_id: str) -> str:
        if not fired:  # the submitter has checked the state: the user cancels now
            fired.append(control.cancel(other, "racy"))
        return real(kind, custom_id)

    monkeypatch.setattr(record, "queued_value", cancel_midway)
    lines = jsonl(10, prefix="racy").decode().split("\n")
    submit_batch(redis, BatchSpec("racy", "llm"), lambda: lines, chunk=5)
    state = record.read_state(redis, "racy")
    assert fired == ["cancelled"] and state is not None
    assert state["state"] == "cancelled" and state["enqueued"] == 0, state
    assert not _queued(redis) and not redis.hlen(batch_lines_key("racy"))


# -- 4. isolation -----------------------------------------------------------------------------------


def test_files_and_batches_are_private_to_their_creator(redis: Redis, gateways: Gateways) -> None:
    gw = gateways.start(gateway__api_keys=["key-alice", "key-bob"])
    alice = batch_of(gw.url, jsonl(2), "key-alice")
    file_id, bid = alice["input_file_id"], alice["id"]
    owner = redis.hget(f"fleet:file:{file_id}", "owner")
    assert owner and b"key-alice" not in owner and owner == redis.hget(batch_key(bid), "owner")
    for path in (f"/v1/files/{file_id}", f"/v1/files/{file_id}/content", f"/v1/batches/{bid}",
                 f"/v1/files/file-err-{bid}", f"/v1/files/file-out-{bid}/content"):
        assert httpx.get(gw.url + path, headers=auth("key-bob"), timeout=10).status_code == 404, path
    assert httpx.get(f"{gw.url}/v1/files/{file_id}", headers=auth("key-alice"), timeout=10).status_code == 200
    assert httpx.get(f"{gw.url}/v1/batches", headers=auth("key-bob"), timeout=10).json()["data"] == []
    mine = httpx.get(f"{gw.url}/v1/batches", headers=auth("key-alice"), timeout=10).json()["data"]
    assert [b["id"] for b in mine] == [bid]
    assert create(gw.url, file_id, "key-bob").status_code == 404
    cancel = httpx.post(f"{gw.url}/v1/batches/{bid}/cancel", headers=auth("key-bob"), timeout=10)
    assert cancel.status_code == 404
    assert httpx.request("DELETE", f"{gw.url}/v1/files/{file_id}", headers=auth("key-bob"),
                         timeout=10).status_code == 404
    assert record.read_state(redis, bid)["state"] == "in_progress"  # type: ignore[index]


def test_the_gateway_dashboard_redacts_prompts(redis: Redis, workers: Any, gateways: Gateways) -> None:
    workers.start("dash", **FAKE)
    gw = gateways.start()
    wait_until_healthy(gw)
    done = httpx.post(f"{gw.url}/v1/completions", timeout=60,
                      json={"model": "llm", "prompt": "my secret diagnosis", "max_tokens": 2})
    assert done.status_code == 200
    wait_for(lambda: httpx.get(f"{gw.url}/dashboard/api/jobs", timeout=10).json(), 30, "the job in history")
    jobs = httpx.get(f"{gw.url}/dashboard/api/jobs", timeout=10)
    job_id = jobs.json()[0]["id"]
    one = httpx.get(f"{gw.url}/dashboard/api/job/{job_id}", timeout=10)
    for got in (jobs, one):
        assert got.status_code == 200 and "secret" not in got.text, got.text
    assert jobs.json()[0]["params"]["max_tokens"] == 2
    assert httpx.get(f"{gw.url}/dashboard/api/job/recent", timeout=10).status_code == 404


def test_a_keyed_dashboard_needs_a_key_and_shows_prompts_to_holders(redis_url: str, workers: Any) -> None:
    workers.start("dash2", **FAKE)
    port = free_port()
    env = worker_env(redis_url, "dash", gateway__api_keys=["op-key"])
    server = subprocess.Popen([sys.executable, "-m", "ecosystem.cli", "dashboard", "--port", str(port)],
                              env=env, cwd=ROOT, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(url + "/"), 30, "the dashboard")
        from dispatcher import Fleet

        Fleet(redis_url).submit(prompt="operator-visible prompt", max_tokens=2).result(timeout=60)
        assert httpx.get(url + "/", timeout=10).status_code == 200  # the page itself holds no data
        assert "Authorization" in httpx.get(url + "/static/dashboard.js", timeout=10).text
        assert httpx.get(url + "/api/jobs", timeout=10).status_code == 401
        assert httpx.get(url + "/api/status", headers=auth("wrong"), timeout=10).status_code == 401
        jobs = httpx.get(url + "/api/jobs", headers=auth("op-key"), timeout=10)
        assert jobs.status_code == 200 and "operator-visible prompt" in jobs.text
    finally:
        server.terminate()
        server.wait(10)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# -- 5. uploads -------------------------------------------------------------------------------------


def test_uploads_are_bounded_per_creator_and_expire_in_a_day(redis: Redis, gateways: Gateways) -> None:
    gw = gateways.start(gateway__max_files=2, gateway__max_file_storage=3000, gateway__max_file_bytes=2000)
    one = upload(gw.url, b"x" * 1500)
    assert one.status_code == 200 and 0 < redis.ttl(f"fleet:file:{one.json()['id']}") <= 86400
    too_big = upload(gw.url, b"x" * 2001)
    assert too_big.status_code == 413 and "gateway.max_file_bytes" in too_big.text
    over = upload(gw.url, b"x" * 1600)
    assert over.status_code == 413 and "gateway.max_file_storage" in over.text
    assert upload(gw.url, b"x" * 100).status_code == 200
    third = upload(gw.url, b"x" * 10)
    assert third.status_code == 429 and "gateway.max_files" in third.text
    gone = httpx.request("DELETE", f"{gw.url}/v1/files/{one.json()['id']}", timeout=10)
    assert gone.status_code == 200 and gone.json()["deleted"] is True
    assert upload(gw.url, b"x" * 1500).status_code == 200
    big_field = httpx.post(f"{gw.url}/v1/files", files={"file": ("a.jsonl", b"{}")},
                           data={"purpose": "batch" + " " * 2_000_000}, timeout=60)
    assert big_field.status_code == 413, big_field.text
    no_key_without_ttl(redis)


def test_a_file_part_is_refused_as_soon_as_it_passes_the_limit(gateways: Gateways) -> None:
    gw = gateways.start(gateway__max_file_bytes=1024 * 1024)
    boundary = "fleetboundary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.jsonl\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        sock.sendall(f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
                     f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n".encode())
        for part in (head, *[b"x" * 65536] * 20):  # 1.25 MiB of the file, and the body goes on
            sock.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        sock.settimeout(10)
        reply = sock.recv(65536)  # before: no answer while the rest of the body was awaited
        while b"}" not in reply.partition(b"\r\n\r\n")[2]:
            reply += sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"gateway.max_file_bytes" in reply


# -- the model, end to end --------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.slow
def test_odd_line_breaks_run_to_the_end_on_the_model(workers: Any, gateways: Gateways) -> None:
    workers.start("model-w1", backend__slots=4)
    gw = gateways.start(gateway__api_keys=["k1"])
    wait_until_healthy(gw)
    batch = batch_of(gw.url, jsonl(3, prompt="Line\u2028one\u0085two").replace(b"\n", b"\r\n"), "k1")
    bid = batch["id"]

    def ended() -> dict[str, Any] | None:
        b = httpx.get(f"{gw.url}/v1/batches/{bid}", headers=auth("k1"), timeout=10).json()
        return b if b["status"] in ("completed", "failed", "cancelled") else None

    done = wait_for(ended, 240, "the batch to end", interval=0.5)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 3
    out = httpx.get(f"{gw.url}/v1/files/{done['output_file_id']}/content", headers=auth("k1"), timeout=10)
    rows = [json.loads(x) for x in out.text.split("\n") if x]
    assert sorted(r["custom_id"] for r in rows) == ["req-0", "req-1", "req-2"]
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 2 for r in rows)
