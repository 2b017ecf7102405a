"""The gateway while its Redis is away and once it is back (found by `fleet soak`): every route
answers 503 `redis_unavailable` while Redis is down (files and batches answered 500), and a
restarted Redis leaves no dead pooled connection behind (each failed one request, long after
Redis was back). A private redis-server, a real worker (fake engine) and a real `fleet serve`."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from ecosystem.local.processes import RedisServer, start_gateway, start_worker, wait_until_healthy
from tests.harness import ROOT

pytestmark = pytest.mark.timeout(180)
LINE = b'{"custom_id":"a","method":"POST","url":"/v1/completions","body":{"model":"llm","prompt":"hi"}}\n'
CHAT = {"model": "llm", "messages": [{"role": "user", "content": "a b c d e f g h"}], "max_tokens": 8}


def test_every_route_answers_503_while_redis_is_down(tmp_path: Path) -> None:
    with RedisServer.start(tmp_path / "redis") as server:
        worker = start_worker(server.url, "w1", tmp_path / "logs", backend__type="fake")
        gw = start_gateway(server.url, tmp_path / "logs", cwd=ROOT)
        try:
            server.stop(signal.SIGKILL)
            answers = {
                "upload": httpx.post(f"{gw.url}/v1/files", files={"file": ("x.jsonl", LINE)},
                                     data={"purpose": "batch"}, timeout=30),
                "batch": httpx.post(f"{gw.url}/v1/batches", timeout=30, json={
                    "input_file_id": "file-" + "0" * 24, "endpoint": "/v1/completions"}),
                "batch status": httpx.get(f"{gw.url}/v1/batches/batch_{'0' * 24}", timeout=30),
                "chat": httpx.post(f"{gw.url}/v1/chat/completions", json=CHAT, timeout=30),
            }
            for what, answer in answers.items():
                assert answer.status_code == 503, (what, answer.status_code, answer.text[:300])
                assert answer.json()["error"]["code"] == "redis_unavailable", what
        finally:
            gw.stop()
            worker.kill()


def test_a_restarted_redis_leaves_no_dead_connection_to_fail_a_request(tmp_path: Path) -> None:
    with RedisServer.start(tmp_path / "redis", extra=["--appendonly", "yes"]) as server:
        worker = start_worker(server.url, "w1", tmp_path / "logs", backend__type="fake", backend__slots=8,
                              backend__step_delay=0.05)
        gw = start_gateway(server.url, tmp_path / "logs", cwd=ROOT)
        wait_until_healthy(gw)

        def burst(n: int) -> list[int]:
            codes: list[int] = []
            threads = [threading.Thread(target=lambda: codes.append(
                httpx.post(f"{gw.url}/v1/chat/completions", json=CHAT, timeout=60).status_code))
                for _ in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return codes

        try:
            assert burst(8) == [200] * 8  # eight pooled connections, all in use at once
            server.restart(signal.SIGKILL, 1.0)
            wait_until_healthy(gw)
            time.sleep(3)
            for _ in range(3):
                assert burst(8) == [200] * 8
        finally:
            gw.stop()
            worker.kill()
