"""Every entry point of the fleet under the ACL the docs recommend (`+@all -@dangerous`): workers
(the real engine and the fake one), the gateway's routes, the CLI's producer, status and batch
commands, and the reaper. Redis records each command it refuses in its ACL LOG; after each test
that log holds no refusal of the fleet's user (beyond what a test names as tolerated)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam
from redis import Redis

from backends.contract.connect import (
    MIN_REDIS_VERSION,
    RedisTooOld,
    check_version,
    parse_hello,
    server_version,
)
from backends.contract.keys import DIED_ON_FIELD, inflight_key, job_key, worker_key
from dispatcher import Fleet
from dispatcher.aio import AsyncFleet
from ecosystem.local.processes import RedisServer
from tests.gateway_harness import GatewayProcess, start_gateway, wait_until_healthy
from tests.harness import ROOT, wait_for, worker_env
from tests.reliability_checks import fleet_workers, start_guarded_redis

pytestmark = pytest.mark.timeout(420)

# the documented fleet user (docs/reliability.md, "Security"); the admin runs ACL LOG and FLUSHALL
ACL = ["--requirepass", "admin-secret",
       "--user", "fleet", "on", ">fleet-secret", "~*", "&*", "+@all", "-@dangerous"]


@dataclass
class AclRedis:
    server: RedisServer
    admin: Redis
    tolerated: set[str] = field(default_factory=set)  # commands a test expects refused

    @property
    def url(self) -> str:
        return f"redis://fleet:fleet-secret@127.0.0.1:{self.server.port}/0"

    def refusals(self) -> list[dict[str, Any]]:
        """What Redis refused the fleet's user since the last reset (ACL LOG)."""
        entries = self.admin.execute_command("ACL", "LOG")
        out = []
        for entry in entries:
            fields = entry if isinstance(entry, dict) else dict(zip(entry[::2], entry[1::2], strict=True))
            fields = {_text(k): _text(v) for k, v in fields.items()}
            if fields.get("username") == "fleet" and fields.get("object") not in self.tolerated:
                out.append(fields)
        return out


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    admin = "redis://:admin-secret@127.0.0.1:{}/0".format
    server = start_guarded_redis(tmp_path_factory.mktemp("acl-redis"), ACL, admin)
    try:
        yield server
    finally:
        server.stop(signal.SIGKILL)


@pytest.fixture
def acl(acl_server: RedisServer) -> Iterator[AclRedis]:
    admin = Redis.from_url(f"redis://:admin-secret@127.0.0.1:{acl_server.port}/0")
    admin.flushall()
    admin.execute_command("ACL", "LOG", "RESET")
    found = AclRedis(acl_server, admin)
    yield found
    refused = found.refusals()
    assert refused == [], f"the fleet's ACL user was refused: {refused}"


@contextlib.contextmanager
def gateway(url: str, logs: Path) -> Iterator[GatewayProcess]:
    gw = start_gateway(url, logs, name="acl-gateway")
    try:
        yield gw
    finally:
        if gw.alive():
            gw.stop(signal.SIGKILL)
    assert "Traceback" not in gw.output(), gw.output()[-3000:]


def fleet_cli(url: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ecosystem.cli", *args], env=worker_env(url, "cli"),
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def batch_lines(n: int) -> str:
    lines = []
    for i in range(n):
        body = {"model": "llm", "prompt": f"Item {i}:", "max_tokens": 3, "temperature": 0}
        lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                                 "body": body}))
    return "\n".join(lines) + "\n"


@pytest.mark.model
def test_gateway_routes_on_the_real_engine_as_the_acl_user(acl: AclRedis, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    with fleet_workers(acl.url, logs) as workers, gateway(acl.url, logs) as gw:
        workers.start("acl-llama", backend__slots=4)
        wait_until_healthy(gw)
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]
        raw = client.chat.completions.with_raw_response.create(model="llm", messages=messages,
                                                               max_tokens=6, temperature=0)
        chat, chat_job = cast(ChatCompletion, raw.parse()), raw.headers["x-fleet-job-id"]
        assert chat.choices[0].message.content and chat.usage and chat.usage.completion_tokens > 0
        chunks = list(client.chat.completions.create(model="llm", messages=messages, max_tokens=6,
                                                     temperature=0, stream=True))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == chat.choices[0].message.content

        generated = httpx.post(f"{gw.url}/api/generate", timeout=120, json={
            "model": "llm", "prompt": "Once upon a time", "stream": False, "options": {"num_predict": 6}})
        assert generated.status_code == 200, generated.text
        assert generated.json()["done"] is True and generated.json()["response"]

        metrics = httpx.get(f"{gw.url}/metrics", timeout=30)
        up = [x for x in metrics.text.splitlines()
              if x.startswith("llama_fleet_worker_up{") and '"acl-llama"' in x]
        assert metrics.status_code == 200 and up and up[0].endswith(" 1.0"), metrics.text
        status = httpx.get(f"{gw.url}/dashboard/api/status", timeout=30)
        assert status.status_code == 200 and "acl-llama" in status.text, status.text
        jobs = httpx.get(f"{gw.url}/dashboard/api/jobs", timeout=30)
        assert jobs.status_code == 200 and chat_job in jobs.text, jobs.text
        job = httpx.get(f"{gw.url}/dashboard/api/job/{chat_job}", timeout=30)
        assert job.status_code == 200 and "acl-llama" in job.text, job.text


def test_gateway_batches_as_the_acl_user(acl: AclRedis, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    with fleet_workers(acl.url, logs) as workers, gateway(acl.url, logs) as gw:
        workers.start("acl-fake", backend__type="fake")
        wait_until_healthy(gw)
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        uploaded = client.files.create(file=("in.jsonl", batch_lines(2).encode()), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + 60
        while batch.status not in ("completed", "failed", "cancelled") and time.monotonic() < deadline:
            time.sleep(0.5)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed" and batch.output_file_id, batch
        lines = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in lines) == ["req-0", "req-1"]


def test_cli_producers_and_status_as_the_acl_user(acl: AclRedis, tmp_path: Path) -> None:
    with fleet_workers(acl.url, tmp_path / "logs") as workers:
        workers.start("acl-fake", backend__type="fake")
        submitted = fleet_cli(acl.url, "submit", "through the ACL", "--max-tokens", "4", "--json")
        assert submitted.returncode == 0, submitted.stderr
        assert json.loads(submitted.stdout)["worker"] == "acl-fake"
        job = Fleet(acl.url).submit(prompt="by the Python API", max_tokens=4)
        assert job.result(timeout=30)["text"] == "by the Python API"

        status = fleet_cli(acl.url, "status", "--json")
        assert status.returncode == 0, status.stderr
        assert [w["name"] for w in json.loads(status.stdout)["workers"]] == ["acl-fake"]
        listed = fleet_cli(acl.url, "jobs")
        assert listed.returncode == 0, listed.stderr
        shown = fleet_cli(acl.url, "job", job.id, "--json")
        assert shown.returncode == 0 and "acl-fake" in shown.stdout, shown.stderr
        scale = fleet_cli(acl.url, "scale", "--suggest", "--json")
        assert scale.returncode == 0 and json.loads(scale.stdout)["live_workers"] == 1, scale.stderr


def test_cli_batches_as_the_acl_user(acl: AclRedis, tmp_path: Path) -> None:
    with fleet_workers(acl.url, tmp_path / "logs") as workers:
        workers.start("acl-fake", backend__type="fake")
        path = tmp_path / "in.jsonl"
        path.write_text(batch_lines(3))
        run = fleet_cli(acl.url, "batch", "submit", str(path), "--id", "acl-batch", "--wait")
        assert run.returncode == 0, run.stderr[-2000:]
        for args in (("status", "acl-batch"), ("list",)):
            shown = fleet_cli(acl.url, "batch", *args)
            assert shown.returncode == 0 and "acl-batch" in shown.stdout, shown.stderr
        out = tmp_path / "out.jsonl"
        results = fleet_cli(acl.url, "batch", "results", "acl-batch", "-o", str(out))
        assert results.returncode == 0, results.stderr
        assert sorted(json.loads(x)["custom_id"] for x in out.read_text().splitlines()) == [
            "req-0", "req-1", "req-2"]


def test_reaper_requeues_a_dead_workers_job_as_the_acl_user(acl: AclRedis, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    user = Redis.from_url(acl.url)
    with fleet_workers(acl.url, logs) as workers:
        # paced, so the job is still running when its worker dies
        doomed = workers.start("acl-doomed", backend__type="fake", backend__step_delay=0.2)
        job_id = asyncio.run(submit_async(acl.url, " ".join(f"w{i}" for i in range(60)), 60))
        wait_for(lambda: user.lrange(inflight_key("acl-doomed"), 0, -1) == [job_id.encode()], 30,
                 "the first worker to claim the job")
        workers.start("acl-heir", backend__type="fake")
        doomed.kill()
        result = Fleet(acl.url).job(job_id).result(timeout=90)
    assert result["worker"] == "acl-heir" and result["attempt"] >= 2, result
    died_on = user.hget(job_key(job_id), DIED_ON_FIELD)
    assert died_on is not None and b"acl-doomed" in died_on


async def submit_async(url: str, prompt: str, max_tokens: int) -> str:
    """Submit as the gateway does (AsyncFleet): no RQ version probe, so no refusal to tolerate."""
    async with AsyncFleet(url) as fleet:
        return (await fleet.submit(prompt=prompt, max_tokens=max_tokens)).id


def test_the_server_version_comes_from_hello_which_the_acl_user_may_send(acl: AclRedis) -> None:
    for protocol in (2, 3):  # a flat list of pairs, or a map
        client = Redis.from_url(acl.url, protocol=protocol)
        reply = client.execute_command("HELLO")
        server, version = parse_hello(reply)
        assert server == "redis" and version >= MIN_REDIS_VERSION
        assert server_version(client, acl.url) == version
        # the same reply from a 6.2 server: refused, with the version, the redacted URL and the need
        if isinstance(reply, dict):
            older: Any = {k: (b"6.2.14" if k == b"version" else v) for k, v in reply.items()}
        else:
            older = [b"6.2.14" if i and reply[i - 1] == b"version" else v for i, v in enumerate(reply)]
        assert parse_hello(older)[1] == (6, 2, 14)
        with pytest.raises(RedisTooOld, match=r"^redis 6\.2\.14 at redis://fleet:\*\*\*@127\.0\.0\.1:\d+/0 "
                                              r"is too old: llama-fleet needs Redis >= 7\.0$"):
            check_version(parse_hello(older)[1], acl.url)
    asyncio.run(check_async(acl.url))  # the gateway's check passes on this (>= 7) server


async def check_async(url: str) -> None:
    async with AsyncFleet(url) as fleet:
        await fleet.check_server()
        job = await fleet.submit(prompt="queued under the ACL", max_tokens=2)
        assert await job.status() == "queued"


def test_a_server_without_hello_stops_the_worker_and_the_async_producer(tmp_path: Path) -> None:
    """Redis before 6.2 has no argument-less HELLO; a server with HELLO renamed away answers the
    same, over RESP2 (redis-py's RESP3 handshake needs HELLO)."""
    def resp2(port: int) -> str:
        return f"redis://127.0.0.1:{port}/0?protocol=2"

    server = start_guarded_redis(tmp_path / "redis", ["--rename-command", "HELLO", '""'], resp2)
    url = resp2(server.port)
    try:
        env = worker_env(url, "too-old", backend__type="fake")
        run = subprocess.run([sys.executable, "-m", "ecosystem.cli", "worker"], cwd=ROOT, text=True,
                             capture_output=True, timeout=60, env=env)
        assert run.returncode != 0 and "llama-fleet needs Redis >= 7.0" in run.stderr, run.stderr[-3000:]
        assert "Traceback" not in run.stderr and not Redis.from_url(url).exists(worker_key("too-old"))

        async def submit() -> None:
            async with AsyncFleet(url) as fleet:
                await fleet.submit(prompt="never queued", max_tokens=2)

        with pytest.raises(RedisTooOld, match=r"llama-fleet needs Redis >= 7\.0"):
            asyncio.run(submit())
        assert Redis.from_url(url).llen("rq:queue:llm:default") == 0
    finally:
        server.stop(signal.SIGKILL)
