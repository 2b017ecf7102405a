"""`fleet soak` (ecosystem/soak/): the whole fleet under seeded traffic and faults, every invariant
checked once it is quiet again.

The default suite runs a short seeded soak on the fake engine with every fault kind, and a short
phase on the real model; both must end with no violation, and the faults must have hit what makes
them worth running: a named tenant's job streaming on the worker killed with -9 (a tenant job
stranded after a kill would be caught), and a named tenant's job cancelled while queued (a
cancelled job keeping its tenant's places would be caught). `-m soak` runs the long soak: 30
minutes on the real model, then a Sentinel failover phase."""

from __future__ import annotations

import io
import socket
from collections import Counter
from pathlib import Path

import pytest
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rich.console import Console

from ecosystem.local.processes import RedisServer
from ecosystem.soak.client import Call, Record, classify
from ecosystem.soak.faults import MAIN_KINDS, SENTINEL_KINDS
from ecosystem.soak.kinds import Kinds
from ecosystem.soak.plan import SoakPlan
from ecosystem.soak.proxy import LinkProxy
from ecosystem.soak.report import (
    QuietProgress,
    queued_tenant_cancels,
    render,
    tenant_jobs_on_killed_workers,
    write_json,
)
from ecosystem.soak.run import PhaseResult, SoakResult, run_soak

pytestmark = pytest.mark.timeout(900)


def soak(tmp_path: Path, **plan: object) -> SoakResult:
    result = run_soak(SoakPlan(run_dir=tmp_path / "run", **plan), QuietProgress())  # type: ignore[arg-type]
    write_json(result, tmp_path / "soak.json")
    return result


def report(result: SoakResult) -> str:
    out = io.StringIO()
    render(result, Console(file=out, width=160))
    return out.getvalue()


def assert_faults_hit(phase: PhaseResult, kinds: tuple[str, ...]) -> None:
    ran = Counter(f.kind for f in phase.faults)
    assert set(ran) == set(kinds), ran
    assert not [f.error for f in phase.faults if f.error]
    if "worker_kill9" in kinds:
        assert tenant_jobs_on_killed_workers(phase.faults), "no named tenant's job ran on a killed worker"
    if "queued_cancel" in kinds:
        assert [c for c in queued_tenant_cancels(phase) if c["tenant"] != "default"], \
            "no named tenant's job was cancelled while queued"


def assert_hostile_met(phase: PhaseResult, fake: bool) -> None:
    """Every hostile input was sent and refused (a 4xx: the checks hold any other answer a
    violation), none left a worker's loop or a model's lock held (the run's own invariants)."""
    met = {r.case for r in phase.records if r.kind == "hostile_input" and r.outcome == "refused"}
    assert met == set(Kinds(fake).hostile_cases()), met


# alone: under the parallel run (a clean clone's CI rehearsal) its tenant ledger once counted one
# request more than the jobs held; on the whole machine it held in every run
@pytest.mark.alone
@pytest.mark.model
def test_short_soak_on_the_fake_engine(tmp_path: Path) -> None:
    result = soak(tmp_path, seed=11, duration=55, backend="fake")
    phase = result.phases[0]
    assert_faults_hit(phase, MAIN_KINDS)
    assert_hostile_met(phase, fake=True)
    assert len(phase.records) > 100 and phase.batches
    assert result.ok, report(result)


@pytest.mark.model
def test_short_soak_on_the_real_model(tmp_path: Path) -> None:
    result = soak(tmp_path, seed=12, duration=30, backend="llama-cpp", clients=3, slots=4,
                  faults=("worker_kill9", "queued_cancel"))
    assert_faults_hit(result.phases[0], ("worker_kill9", "queued_cancel"))
    assert_hostile_met(result.phases[0], fake=False)
    assert result.ok, report(result)
    # the workers shared a KV store through kills and tenants: entries written, none ever found
    # truncated, corrupt or foreign (each would be removed with a warning in a worker's log)
    run = tmp_path / "run"
    assert list((run / "kv-store").rglob("*.kv")), "no conversation reached the KV store"
    logs = "".join(f.read_text(errors="replace") for f in run.rglob("*.log"))
    assert "KV store: removed" not in logs and "KV store: cannot write" not in logs


@pytest.mark.soak
@pytest.mark.timeout(3 * 3600)
def test_long_soak_on_the_real_model_with_a_failover(tmp_path: Path) -> None:
    result = soak(tmp_path, seed=21, duration=1800, backend="llama-cpp", clients=4, slots=4, sentinel=True,
                  sentinel_duration=300)
    main, failover = result.phases
    assert_faults_hit(main, MAIN_KINDS)
    assert Counter(f.kind for f in main.faults)["worker_kill9"] >= 3  # rounds of every kind
    assert_faults_hit(failover, SENTINEL_KINDS)
    assert result.ok, report(result)


# -- the parts, without a fleet ------------------------------------------------------------------------


def test_a_cut_link_is_a_black_hole_and_a_restored_one_reconnects(tmp_path: Path) -> None:
    with RedisServer.start(tmp_path / "redis") as server:
        proxy = LinkProxy(server.port)
        try:
            client = Redis.from_url(proxy.url, socket_timeout=0.5, socket_connect_timeout=0.5)
            assert client.ping()
            proxy.cut()
            with pytest.raises((RedisTimeoutError, RedisConnectionError, socket.timeout)):
                client.ping()  # no answer, no reset: the command hangs until the timeout
            proxy.restore()
            assert client.ping()  # the dropped connection is replaced at once
        finally:
            proxy.close()


@pytest.mark.parametrize(("status", "fields", "outcome"), [
    (200, {"final": True}, "ok"),
    (200, {}, "unclear"),
    (200, {"error_event": True, "message": "generation failed: x"}, "error_event"),
    (429, {"message": "tenant 'bots' reached its max_concurrent limit"}, "refused"),
    (503, {"message": "the fleet's Redis is unreachable", "code": "redis_unavailable"}, "redis_503"),
    (503, {"message": "no live worker serves pool 'llm'", "code": "no_workers"}, "no_workers_503"),
    (500, {"message": "Internal Server Error"}, "server_error"),
    (504, {"message": "job x did not finish within 8s"}, "timeout_504"),
    (None, {"exception": "RemoteProtocolError"}, "connection_lost"),
])
def test_what_a_client_was_told(status: int | None, fields: dict[str, object], outcome: str) -> None:
    record = Record(1, 0, "chat", "default", 0, None, False, 0.0, status=status)
    for k, v in fields.items():
        setattr(record, k, v)
    assert classify(record, Call("chat", "default", None, "/v1/chat/completions")) == outcome
