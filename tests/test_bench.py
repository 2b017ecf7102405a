"""`fleet bench`: its arithmetic, and tiny real runs (redis-server, a fleet worker, llama-server; over
HTTP also `fleet serve`)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from ecosystem.local.bench import bench
from ecosystem.local.bench_load import (
    LLAMA_SERVER_FIELDS,
    CompletionsTarget,
    Sample,
    again_if_stale,
    openai_chunk,
)
from ecosystem.local.bench_report import FLEET, PEER, Run, percentile, ratios, summaries


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([float(x) for x in range(1, 101)], 95) == pytest.approx(95.05)


def test_summaries_pool_rounds_and_ratio_is_fleet_over_peer() -> None:
    def run(role: str, round_: int, wall: float, tokens: int) -> Run:
        samples = [Sample(0.1, 1.0, tokens), Sample(0.3, 2.0, tokens), Sample(None, 0.5, 0, "boom")]
        return Run(4, role, role, round_, wall, samples, {"client": 0.5})

    rows = summaries([run(PEER, 0, 2.0, 50), run(FLEET, 0, 2.0, 40), run(FLEET, 1, 2.0, 60)])
    fleet, peer = rows  # the fleet row first
    assert (fleet.role, fleet.requests, fleet.errors, fleet.tokens) == (FLEET, 6, 2, 200)
    assert fleet.tok_s == 50.0 and peer.tok_s == 50.0  # 200 tokens / 4 s, 100 / 2 s
    assert fleet.cpu_s_per_1k_tokens == {"client": 5.0}
    assert fleet.first_error == "boom" and fleet.tokens_per_request == 50.0
    assert ratios(rows)[("short", 4)]["tok_s"] == 1.0


@pytest.mark.model
@pytest.mark.timeout(300)
def test_one_small_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(bench, ["--users", "1,2", "--requests-per-user", "1", "--max-tokens", "4",
                                        "--ctx-per-user", "256", "--no-warmup", "--out", str(out),
                                        "--fleet-set", "prefix_cache=0"])
    assert result.exit_code == 0, result.output
    assert "fleet (llama-cpp)" in result.output and "llama-server -np 2" in result.output
    doc = json.loads(out.read_text())
    assert [(r["users"], r["role"]) for r in doc["summary"]] == [(1, FLEET), (1, PEER), (2, FLEET), (2, PEER)]
    for row in doc["summary"]:
        assert row["errors"] == 0 and row["tokens"] == 4 * row["users"] and row["tok_s"] > 0
        assert row["ttft_p50_ms"] > 0 and row["e2e_p95_ms"] >= row["ttft_p95_ms"]
    assert set(doc["ratios_fleet_over_peer"]["short"]) == {"1", "2"}
    assert doc["meta"]["config"]["fleet_backend"] == "llama-cpp"
    assert doc["meta"]["config"]["fleet_settings"] == ["prefix_cache=0"]
    assert out.with_suffix(".html").read_text().count("<polyline") >= 8  # 4 plots x (fleet, peer)


@pytest.mark.model
@pytest.mark.timeout(180)
def test_one_small_run_over_http(tmp_path: Path) -> None:
    """`--via http`: fleet serve and llama-server, each over /v1/completions with the same body."""
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(bench, ["--via", "http", "--users", "1,2", "--requests-per-user", "1",
                                        "--max-tokens", "4", "--ctx-per-user", "256", "--no-warmup",
                                        "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "fleet serve (llama-cpp)" in result.output and "via HTTP" in result.output
    doc = json.loads(out.read_text())
    assert doc["meta"]["via"] == "http" and doc["meta"]["config"]["via"] == "http"
    assert [(r["users"], r["role"]) for r in doc["summary"]] == [(1, FLEET), (1, PEER), (2, FLEET), (2, PEER)]
    for row in doc["summary"]:
        assert row["errors"] == 0, row["first_error"]
        assert row["tokens"] == 4 * row["users"] and row["tok_s"] > 0  # the usage each side reported
        assert row["ttft_p50_ms"] > 0 and row["e2e_p95_ms"] >= row["ttft_p95_ms"]
        # the gateway's CPU is the fleet side's: it shares the cores with the worker
        assert ("gateway" in row["cpu_s_per_1k_tokens"]) == (row["role"] == FLEET)


def test_over_http_both_sides_get_the_same_body() -> None:
    gateway = CompletionsTarget("http://127.0.0.1:1", 1, seed=7)
    server = CompletionsTarget.llama_server("http://127.0.0.1:1", 1, seed=7)
    ours, theirs = gateway.body("Hi", 4), server.body("Hi", 4)
    assert ours == {"model": "llm", "prompt": "Hi", "max_tokens": 4, "temperature": 0.0, "seed": 7,
                    "stream": True, "stream_options": {"include_usage": True}}
    assert {k: v for k, v in theirs.items() if k not in LLAMA_SERVER_FIELDS} == ours
    assert theirs["cache_prompt"] is True and theirs["top_k"] == 40  # what /completion gets too
    gateway.close()
    server.close()


def test_over_http_tokens_are_the_usage_else_llama_servers_timings() -> None:
    assert openai_chunk({"choices": [{"text": "Hi", "finish_reason": None}], "usage": None}) == (True, None)
    assert openai_chunk({"choices": [], "usage": {"completion_tokens": 5}}) == (False, 5)
    last = {"choices": [{"text": "", "finish_reason": "length"}], "timings": {"predicted_n": 4}}
    assert openai_chunk(last) == (False, 4)
    assert openai_chunk({"choices": [{"text": "", "finish_reason": "stop"}]}) == (False, None)


def test_fleet_set_must_be_key_value() -> None:
    result = CliRunner().invoke(bench, ["--fleet-set", "batch_invariant"])
    assert result.exit_code == 2 and "'batch_invariant' is not KEY=VALUE" in result.output


def test_a_request_on_a_stale_connection_is_sent_once_more() -> None:
    calls: list[float] = []

    def flaky(t0: float) -> Sample:  # the server had closed the kept-alive connection, once
        calls.append(t0)
        if len(calls) == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return Sample(0.1, 0.2, 8)

    assert again_if_stale(flaky) == Sample(0.1, 0.2, 8)
    assert len(calls) == 2 and calls[0] == calls[1]  # the second try runs on the first one's clock

    def dead(t0: float) -> Sample:
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.")

    failed = again_if_stale(dead)
    assert failed.tokens == 0 and failed.error is not None and "RemoteProtocolError" in failed.error
