"""`fleet bench --workload chat`: its arithmetic, its options, and one tiny real run (redis-server,
a fleet worker behind a real `fleet serve`, a real llama-server's own HTTP API)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ecosystem.local.bench import bench
from ecosystem.local.bench_chat import FLEET, HISTORIES, STORE
from ecosystem.local.bench_chat_report import ChatRun, summarise

PEER = "llama-server"


def test_ratios_are_medians_of_per_round_ratios() -> None:
    def run(system: str, round_: int, tokens: int, later: list[float]) -> ChatRun:
        return ChatRun(system, "real", round_, wall_s=2.0, tokens=tokens, ttft_first_ms=[900.0],
                       ttft_later_ms=later, cpu_s=tokens / 100)  # 10 CPU s per 1k tokens

    runs = [run(FLEET, 0, 100, [100.0, 300.0]), run(PEER, 0, 50, [400.0, 400.0]),
            run(PEER, 1, 100, [100.0, 100.0]), run(FLEET, 1, 100, [100.0, 100.0]),
            run(FLEET, 2, 30, [50.0, 50.0]), run(PEER, 2, 60, [100.0, 100.0])]
    summary = summarise(runs, [FLEET, PEER], ["real"])
    fleet, peer = summary[f"real/{FLEET}"], summary[f"real/{PEER}"]
    assert (fleet["tok_s"], peer["tok_s"]) == (50.0, 30.0)  # medians of 50/50/15 and 25/50/30 tok/s
    assert fleet["tok_s_vs_peer"] == 1.0  # rounds: 2.0, 1.0, 0.5
    assert fleet["ttft_later_vs_peer"] == 0.5  # rounds: 200/400, 100/100, 50/100
    assert fleet["ttft_later_p50_ms"] == 100.0 and fleet["ttft_first_p50_ms"] == 900.0
    assert peer["tok_s_vs_peer"] == 1.0 and fleet["round_tok_s"] == [50.0, 50.0, 15.0]
    assert fleet["cpu_s_per_1k"] == peer["cpu_s_per_1k"] == 10.0 and fleet["cpu_vs_peer"] == 1.0


@pytest.mark.parametrize(("args", "message"), [
    (["--workload", "chat,short"], "chat runs alone"),
    (["--workload", "chat", "--users", "2,4"], "--workload chat takes one user count"),
    (["--workload", "chat", "--requests-per-user", "3"], "--requests-per-user does not apply to --workload"),
    (["--workload", "chat", "--fleet-backend", "llama-server"], "--fleet-backend does not apply"),
    (["--turns", "3"], "--turns applies to --workload chat only"),
    (["--slots", "2"], "--slots applies to --workload chat only"),
    (["--think-ms", "100"], "--think-ms applies to --workload chat only"),
    (["--workload", "stalls", "--kv-store"], "--kv-store does not apply to --workload stalls"),
    (["--workload", "chat", "--history", "all"], "'all' is not one of 'real', 'edited', 'both'"),
    (["--workload", "chat", "--turns", "0"], "0 is not in the range x>=1"),
])
def test_chat_options_are_checked(args: list[str], message: str) -> None:
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.model
@pytest.mark.timeout(180)
def test_one_tiny_chat_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "chat.json"
    result = CliRunner().invoke(bench, ["--workload", "chat", "--users", "2", "--turns", "2", "--rounds", "1",
                                        "--max-tokens", "8", "--no-warmup", "--slots", "1", "--kv-store",
                                        "--think-ms", "20", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "Multi-turn chat over HTTP" in result.output
    doc = json.loads(out.read_text())
    assert doc["meta"]["cpu"] and doc["meta"]["systems"] == [STORE, FLEET, PEER]
    meta = doc["meta"]
    assert meta["config"]["users"] == 2 and meta["ctx_per_slot"] >= meta["context_needed"]
    assert meta["config"]["slots"] == 1  # two conversations take turns in one slot on both sides
    summary = doc["summary"]
    assert set(summary) == {f"{h}/{s}" for h in HISTORIES for s in (STORE, FLEET, PEER)}
    for history in HISTORIES:  # the fleet with a KV store answered every turn too
        assert summary[f"{history}/{STORE}"]["errors"] == 0 and summary[f"{history}/{STORE}"]["tok_s"] > 0
    for history in HISTORIES:
        fleet, peer = summary[f"{history}/{FLEET}"], summary[f"{history}/{PEER}"]
        for row in (fleet, peer):
            assert row["errors"] == 0, row["first_error"]
            assert row["tok_s"] > 0 and row["ttft_first_p50_ms"] > 0 and row["ttft_later_p50_ms"] > 0
            assert row["ttft_later_p95_ms"] >= row["ttft_later_p50_ms"]
            assert row["cpu_s_per_1k"] > 0  # the system's processes worked for its tokens
        # the ratios and the numbers they come from are each written rounded
        assert fleet["tok_s_vs_peer"] == pytest.approx(fleet["tok_s"] / peer["tok_s"], abs=2e-3)
        assert fleet["ttft_later_vs_peer"] == pytest.approx(
            fleet["ttft_later_p50_ms"] / peer["ttft_later_p50_ms"], abs=2e-3)
    runs = {(r["system"], r["history"]): r for r in doc["runs"]}
    assert len(runs) == 6
    for history in HISTORIES:
        mine, theirs = runs[FLEET, history], runs[PEER, history]
        assert len(mine["ttft_first_ms"]) == len(theirs["ttft_first_ms"]) == 2  # one per user
        assert len(mine["ttft_later_ms"]) == len(theirs["ttft_later_ms"]) == 2  # users x (turns - 1)
        assert 0 < mine["tokens"] <= 2 * 2 * 8 and 0 < theirs["tokens"] <= 2 * 2 * 8
        # both sides render the same prompt (llama.cpp's gemma template; with jinja llama-server
        # would render the template's name): turn 1 counts the same tokens, two ~480-token openings
        assert mine["first_prompt_tokens"] == theirs["first_prompt_tokens"] > 2 * 400
        # CPU by process group: the fleet's worker does the decoding, the peer is one server
        assert set(mine["cpu_by"]) == {"workers", "gateway", "redis"} and set(theirs["cpu_by"]) == {"servers"}
        assert mine["cpu_by"]["workers"] > mine["cpu_by"]["redis"]
        assert mine["cpu_s"] == pytest.approx(sum(mine["cpu_by"].values()), abs=0.05)
