"""Redis clients from URLs (backends/contract/connect.py), redact_url on Sentinel URLs, and
`fleet health` against a real worker's health file."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from redis.sentinel import SentinelConnectionPool

from backends.contract.connect import async_redis_from_url, parse_sentinel_url, redis_from_url
from backends.contract.redact import redact_url
from ecosystem.cli import cli
from tests.harness import WorkerProcess, wait_for
from worker.health import check_health


def test_sentinel_url_is_parsed() -> None:
    t = parse_sentinel_url("redis+sentinel://app:p%40ss@s1:26379,[::1]:26380,s3/fleet/2"
                           "?sentinel_password=spw")
    assert t.sentinels == (("s1", 26379), ("::1", 26380), ("s3", 26379))
    assert (t.service, t.db, t.username) == ("fleet", 2, "app")
    assert (t.password, t.sentinel_password) == ("p@ss", "spw")
    assert t.tls == {}
    tls = parse_sentinel_url("rediss+sentinel://s1/fleet?ssl_cert_reqs=none&db=1")
    assert tls.tls == {"ssl": True, "ssl_cert_reqs": "none"} and tls.db == 1


@pytest.mark.parametrize(("url", "problem"), [
    ("redis+sentinel:///fleet/0", "names no Sentinel host"),
    ("redis+sentinel://s1:26379", "names no service"),
    ("redis+sentinel://s1/fleet/x", "database must be a number"),
    ("redis+sentinel://s1:port/fleet", "bad port"),
    ("redis+sentinel://s1/fleet?timeout=3", "unknown Sentinel URL option"),
    ("redis+sentinel://s1/fleet?ssl_ca_certs=ca.pem", "TLS options need"),
])
def test_bad_sentinel_urls_name_the_problem(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_sentinel_url(url)


def test_clients_from_each_kind_of_url(redis_url: str) -> None:
    assert redis_from_url(redis_url).ping()
    sentinel = redis_from_url("redis+sentinel://127.0.0.1:1,127.0.0.1:2/fleet/3", socket_timeout=1)
    assert isinstance(sentinel.connection_pool, SentinelConnectionPool)
    assert sentinel.connection_pool.connection_kwargs["db"] == 3

    async def ping() -> bool:
        client = async_redis_from_url(redis_url)
        try:
            return bool(await client.ping())
        finally:
            await client.aclose()

    assert asyncio.run(ping())


def test_redact_url_hides_sentinel_passwords() -> None:
    shown = redact_url("redis+sentinel://app:pw@s1:26379,s2:26380/fleet/0?sentinel_password=spw")
    assert shown == "redis+sentinel://app:***@s1:26379,s2:26380/fleet/0?sentinel_password=***"


def test_fleet_health_follows_a_real_worker(workers: list[WorkerProcess], tmp_path: Path) -> None:
    health = tmp_path / "health.json"
    w: WorkerProcess = workers.start("hw1", backend__type="fake", health_file=str(health))  # type: ignore[attr-defined]
    wait_for(lambda: check_health(health, ready=True)[0], 20, "the worker to be ready")
    runner = CliRunner()
    assert runner.invoke(cli, ["health", "--file", str(health)]).exit_code == 0
    assert runner.invoke(cli, ["health", "--ready", "--file", str(health)]).exit_code == 0
    assert json.loads(health.read_text())["name"] == "hw1"
    w.kill()
    result = runner.invoke(cli, ["health", "--file", str(health)])
    assert result.exit_code == 1 and "gone" in result.output
    missing = runner.invoke(cli, ["health", "--file", str(tmp_path / "nope.json")])
    assert missing.exit_code == 1 and "no health file" in missing.output
